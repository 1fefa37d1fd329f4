"""The toy mode's model table: a suffix every answer ends with."""

from __future__ import annotations

import dataclasses

from batcher.core.config import ModelConfig, require


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ToyModelConfig(ModelConfig):
    """A toy model: ``suffix`` is what every answer ends with."""

    mode: str = "toy"
    suffix: str = "!"
    workers: int = 1

    def __post_init__(self) -> None:
        super(ToyModelConfig, self).__post_init__()
        require(len(self.suffix) <= 3, "suffix", "at most 3 characters", self.suffix)


CONFIG = ToyModelConfig
