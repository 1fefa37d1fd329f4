"""The served models by name: each version with its tokenizer and chat template, and the aliases
that resolve to them, weighted (:mod:`gateway.ops.routing`).

Resolution happens once, at admission: the request runs on that version and the response names
it, so a client that asked for ``ferry-fixed`` learns it got ``ferry-fixed@1``. A
:class:`Catalog` is immutable and holds only what takes traffic now; a reload or a weight change
builds a new one and swaps it in whole (:mod:`gateway.ops.rollout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from batcher.core.config import ModelConfig
from batcher.core.tokenizer import Tokenizer
from gateway.config import AliasConfig
from gateway.ops.routing import Split
from gateway.text.chat import ChatTemplate, make_template
from gateway.text.tokenizer import make_tokenizer
from gateway.wire.api import NotFound


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    name: str = dataclasses.field(init=False)  # the config's, read several times a request

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.config.name)


class Catalog:
    """The versions that take traffic, and every alias's split over them."""

    def __init__(self, models: Sequence[ServedModel], splits: Iterable[Split] = ()) -> None:
        self.models = list(models)
        self._by_name = {served.name: served for served in self.models}
        self.splits = {split.alias: split for split in splits}

    @classmethod
    def of(cls, models: Sequence[ModelConfig], aliases: Sequence[AliasConfig] = ()) -> Catalog:
        """Every version of a configuration, each loaded now (a bad tokenizer names its model)."""
        return cls([served_model(model, f"models[{index}]") for index, model in enumerate(models)],
                   splits_of(models, aliases))

    def resolve(self, name: str, session: str = "") -> ServedModel:
        """The version a name stands for; for an alias, the one this session's point falls on.
        :class:`NotFound` if the name is neither."""
        split = self.splits.get(name)
        served = self._by_name.get(split.pick(session) if split is not None else name)
        if served is None:
            known = ", ".join(sorted((*self._by_name, *self.splits)))
            raise NotFound(f"model: {name[:200]!r} is not served here; try one of: {known}")
        return served

    def names(self) -> list[str]:
        """The versions, in configuration order."""
        return [served.name for served in self.models]

    def windows(self) -> list[tuple[str, int]]:
        """Every name served, the versions then the aliases, with its context window (an alias's
        is the smallest of its versions': what any request through it can count on)."""
        return [(name, self.window(name)) for name in (*self.names(), *self.splits)]

    def window(self, name: str) -> int:
        """A served name's context window; :class:`NotFound` if the name is not served."""
        split = self.splits.get(name)
        versions = [version for version, _ in split.weights] if split is not None else [name]
        windows = [self._by_name[v].config.context_window for v in versions if v in self._by_name]
        if not windows:
            self.resolve(name)  # raises NotFound, naming what is served
        return min(windows)


def splits_of(models: Sequence[ModelConfig], aliases: Sequence[AliasConfig]) -> list[Split]:
    """A model's own ``aliases`` (all of its traffic) and the weighted ``[aliases]`` table."""
    plain = [Split(alias, ((model.name, 1.0),)) for model in models for alias in model.aliases]
    return plain + [Split(alias.name, alias.weights) for alias in aliases]


def served_model(model: ModelConfig, where: str) -> ServedModel:
    """A model's tokenizer and template, loaded once: a bad one names its model."""
    try:
        return ServedModel(
            model, make_tokenizer(model.tokenizer), make_template(model.chat_template, model.tokenizer)
        )
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
