"""Tokenizers: how a model counts the tokens of a prompt and of an answer.

Counts decide admission (prompt + ``max_tokens`` must fit the context window), cut answers at
``max_tokens`` and fill ``usage``, so each model has exactly one tokenizer and every count of
that model comes from it. The default is byte-level: one token per UTF-8 byte, exact for any
text, free of vocabulary files, and an upper bound on what a subword tokenizer would count.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int:
        """Tokens in ``text``."""

    def truncate(self, text: str, tokens: int) -> str:
        """The longest prefix of ``text`` that is at most ``tokens`` tokens."""


class ByteTokenizer:
    """One token per UTF-8 byte. A cut never splits a character: a partial one is dropped."""

    name = "bytes"

    def count(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    def truncate(self, text: str, tokens: int) -> str:
        data = text.encode("utf-8", "surrogatepass")
        if len(data) <= tokens:
            return text
        return data[: max(tokens, 0)].decode("utf-8", "ignore")


TOKENIZERS: dict[str, type] = {"bytes": ByteTokenizer}


def make_tokenizer(name: str) -> Tokenizer:
    """The tokenizer a model's config names (``tokenizer = "bytes"``)."""
    try:
        return TOKENIZERS[name]()
    except KeyError:
        raise ValueError(f"tokenizer: expected one of {sorted(TOKENIZERS)}, got {name!r}") from None
