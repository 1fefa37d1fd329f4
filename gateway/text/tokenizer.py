"""Tokenizers: how a model counts, encodes and decodes text, and the one registry of them.

Counts decide admission (prompt + ``max_tokens`` must fit the context window), cut answers at
``max_tokens`` and fill ``usage``; ids are what a continuous engine prefills; decoding turns the
ids an engine streams back into text. So each model has exactly one tokenizer, named in its
config, and every count, id and character of that model comes from it:

- ``bytes``: one token per UTF-8 byte. Exact for any text, free of vocabulary files, and an
  upper bound on what a subword tokenizer would count: the fixed mode's default.
- a path to a Hugging Face ``tokenizer.json`` (or a model directory holding one), loaded with
  the ``tokenizers`` library: the vocabulary a continuous model was trained with.

A stream of ids is decoded with a :class:`Detokenizer`, which never splits a character: a byte
sequence that is not yet a whole UTF-8 character (a byte-level BPE token can end mid-character)
is held until the ids that complete it arrive.
"""

from __future__ import annotations

import codecs
import functools
import os

from batcher.core.config import installed_path
from batcher.core.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character


class ByteTokenizer:
    """One token per UTF-8 byte. A cut never splits a character: a partial one is dropped."""

    name = "bytes"
    vocab_size = 256

    def count(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    def truncate(self, text: str, tokens: int) -> str:
        data = text.encode("utf-8", "surrogatepass")
        if len(data) <= tokens:
            return text
        return data[: max(tokens, 0)].decode("utf-8", "ignore")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()


class ByteDetokenizer:
    """UTF-8 bytes to text as they come: the codec's own incremental decoder holds a partial
    character until its last byte."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: list[int]) -> str:
        return self._decoder.decode(bytes(ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (no transformers at run time).

    Encoding adds no special tokens: the chat template writes them into the prompt itself.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as Vocabulary  # the gateway of a bytes-only config never loads it

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(
                f"tokenizer: expected 'bytes' or a tokenizer.json (or a directory with one), got {path!r}"
            )
        self.name = path
        self._vocabulary = Vocabulary.from_file(file)
        self.vocab_size = self._vocabulary.get_vocab_size(with_added_tokens=True)
        self._vocabulary.no_truncation()  # a file may set them for training (MiniLM's: 128 tokens):
        self._vocabulary.no_padding()  # a count is the whole text's, an encoding the text's alone

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def truncate(self, text: str, tokens: int) -> str:
        encoding = self._vocabulary.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= tokens:
            return text
        if tokens <= 0:
            return ""
        return text[: encoding.offsets[tokens - 1][1]]

    def encode(self, text: str) -> list[int]:
        return self._vocabulary.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._vocabulary.decode(ids, skip_special_tokens=False)

    def detokenizer(self) -> IdDetokenizer:
        return IdDetokenizer(self.decode)


class IdDetokenizer:
    """Incremental decoding for subword vocabularies (the method of TGI and vLLM).

    A token's text can depend on its neighbours (a leading-space marker, bytes of a character
    split over tokens), so the text of new ids is the decoding of a short window of earlier ids
    plus the new ones, less the decoding of the window alone; it is released only once it does
    not end in U+FFFD, the mark of a character still incomplete::

        ids        ... 17 | 902  44 |  (new) 9
                          ^prefix   ^read
        new text = decode(902 44 9) - decode(902 44), when that does not end in U+FFFD

    ``tokenizers.decoders.DecodeStream`` releases the same text push for push (the tests hold
    this class to it on SmolLM2's vocabulary), but it has no end of stream: what it still holds
    when a stream ends (a character cut by ``max_tokens``, and any text pushed with it) would be
    lost, where :meth:`flush` shows it, so it serves as the tests' oracle rather than as this.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window of context ids
        self._read = 0  # ids before this are already shown

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        shown = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(shown) or text.endswith(REPLACEMENT):
            return ""
        del self._ids[: self._read]  # the new window starts at what was read: memory stays small
        self._prefix, self._read = 0, len(self._ids)
        return text[len(shown) :]

    def flush(self) -> str:
        shown = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(shown) :]


@functools.cache
def make_tokenizer(spec: str) -> Tokenizer:
    """The one registry: the tokenizer a model's config names, loaded once per process.

    ``"bytes"``, or a path to a ``tokenizer.json`` or to a model directory holding one (``package:``
    paths inside an installed package: :func:`batcher.core.config.installed_path`).
    """
    if spec == ByteTokenizer.name:
        return ByteTokenizer()
    return HuggingFaceTokenizer(installed_path(spec))
