"""What the core and the gateway need of a model's tokenizer: counting and cutting text (the
gateway's limits, the fixed mode's pricing), encoding and decoding, and an incremental decoder
for a stream of ids (the continuous mode's text). The gateway reads tokenizers
(:mod:`gateway.text.tokenizer`); the core is handed one per model and never reads one itself."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # every token id is below it (a request's logit_bias names ids: checked against it)

    def count(self, text: str) -> int:
        """Tokens in ``text``."""

    def truncate(self, text: str, tokens: int) -> str:
        """The longest prefix of ``text`` that is at most ``tokens`` tokens."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental decoder for one stream of ids."""


class Detokenizes(Protocol):
    """All a stream of ids needs of a tokenizer (the continuous mode's pool and its outputs):
    a :class:`Tokenizer`, or the simulator's ids-as-characters."""

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental decoder for one stream of ids."""


class Detokenizer(Protocol):
    def push(self, ids: list[int]) -> str:
        """The text that ``ids`` complete, after the ids pushed before (never a split character)."""

    def flush(self) -> str:
        """What is left at the end of the stream (an incomplete character shows as U+FFFD)."""
