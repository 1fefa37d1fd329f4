"""The served models by name: every alias resolves to one versioned model, with its tokenizer and
chat template.

Resolution happens once, at admission: the request runs on that version and the response names
it, so a client that asked for ``ferry-fixed`` learns it got ``ferry-fixed@1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batcher.config import ModelConfig
from gateway.api import NotFound
from gateway.chat import ChatTemplate, make_template
from gateway.tokenizer import Tokenizer, make_tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate

    @property
    def name(self) -> str:
        return self.config.name


class Catalog:
    def __init__(self, models: Sequence[ModelConfig]) -> None:
        self.models = [_served(model, f"models[{index}]") for index, model in enumerate(models)]
        self._by_name = {name: served for served in self.models for name in (served.name, *served.config.aliases)}

    def resolve(self, name: str) -> ServedModel:
        """The model a name or alias stands for; :class:`NotFound` if none."""
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(sorted(self._by_name))
            raise NotFound(f"model: {name[:200]!r} is not served here; try one of: {known}") from None

    def names(self) -> list[str]:
        return [served.name for served in self.models]


def _served(model: ModelConfig, where: str) -> ServedModel:
    """A model's tokenizer and template, loaded at start-up: a bad one names its model."""
    try:
        return ServedModel(model, make_tokenizer(model.tokenizer), make_template(model.chat_template, model.tokenizer))
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
