"""The served models by name: every alias resolves to one versioned model, with its tokenizer.

Resolution happens once, at admission: the request runs on that version and the response names
it, so a client that asked for ``ferry-fixed`` learns it got ``ferry-fixed@1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batcher.config import ModelConfig
from gateway.api import NotFound
from gateway.tokenizer import Tokenizer, make_tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    config: ModelConfig
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.config.name


class Catalog:
    def __init__(self, models: Sequence[ModelConfig]) -> None:
        self.models = [ServedModel(model, make_tokenizer(model.tokenizer)) for model in models]
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
