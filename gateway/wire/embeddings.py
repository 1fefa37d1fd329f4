"""OpenAI's ``POST /v1/embeddings`` as a :class:`~gateway.wire.rows.Rows` codec. Pure.

    {model, input: str | [str], encoding_format?: float | base64, dimensions?, user?}
      ──> {object: list, data: [{object: embedding, index, embedding}], model, usage}

Only a model whose table says ``kind = "embedding"`` serves it; ``dimensions`` other than the
model's own is refused unless its table says ``shortenable`` (then each vector is cut to its
first N values and re-normalised). ``base64`` is the vector's float32 bytes, little-endian, as
OpenAI sends them. Token ids as input are refused: ferry's models take text. Errors are
OpenAI's shape (:func:`gateway.wire.openai.error_response`); the fields: docs/http-api.md.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import msgspec

from batcher.core.config import Outputs
from gateway.wire import openai
from gateway.wire.api import InvalidRequest, checked_text, is_int, required, show
from gateway.wire.codec import Head
from gateway.wire.limit_headers import openai as openai_limit_headers
from gateway.wire.rows import json_object, texts, vectors

ENCODINGS = ("float", "base64")


class Embeddings:
    """``POST /v1/embeddings``: one request, its inputs each a job."""

    id_prefix = "emb-"
    idempotency_scope = "embeddings:"
    error_response = staticmethod(openai.error_response)
    limit_headers = staticmethod(openai_limit_headers)
    error_reply = staticmethod(openai.error_reply)

    def __init__(self, model: str, inputs: tuple[str, ...], encoding: str, dimensions: int | None,
                 session: str | None) -> None:
        self.model, self.inputs, self.encoding, self.dimensions = model, inputs, encoding, dimensions
        self.session = session

    @classmethod
    def parse(cls, body: bytes, model: str | None = None) -> Embeddings:
        document = json_object(body)
        name = checked_text(required(document, "model"), "model")
        if not name:
            raise InvalidRequest("model: expected a model name, got an empty string")
        given = required(document, "input")
        if isinstance(given, list) and given and all(is_int(v) or isinstance(v, list) for v in given):
            raise InvalidRequest("input: token ids are not supported; send the text")
        if not isinstance(given, str | list):
            raise InvalidRequest(f"input: expected a string or an array of strings, got {show(given)}")
        inputs = texts([given] if isinstance(given, str) else given, "input")
        encoding = document.get("encoding_format") or "float"
        if encoding not in ENCODINGS:
            raise InvalidRequest(f"encoding_format: expected one of {list(ENCODINGS)}, got {show(encoding)}")
        dimensions = document.get("dimensions")
        if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
            raise InvalidRequest(f"dimensions: expected an integer >= 1, got {show(dimensions)}")
        user = document.get("user")
        return cls(name, inputs, encoding, dimensions, None if user is None else checked_text(user, "user"))

    def fits(self, name: str, outputs: Outputs, mode: str) -> None:
        if outputs.kind != "embedding":
            raise InvalidRequest(f"model: {name} is not an embedding model (it answers with {outputs.kind})")
        if self.dimensions is None or self.dimensions == outputs.dimensions:
            return
        if not outputs.shortenable:
            raise InvalidRequest(
                f"dimensions: {name} gives {outputs.dimensions} dimensions and cannot shorten them, got "
                f"{self.dimensions}")
        if self.dimensions > outputs.dimensions:
            raise InvalidRequest(
                f"dimensions: expected 1..{outputs.dimensions} for {name}, got {self.dimensions}")

    def whole(self, head: Head, answers: Sequence[str] | Sequence[bytes]) -> bytes:
        rows = vectors(answers, self.dimensions)
        if self.encoding == "base64":
            data = [base64.b64encode(row.tobytes()).decode() for row in rows]
        else:
            data = rows.tolist()
        return msgspec.json.encode({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "model": head.model,
            "usage": {"prompt_tokens": head.input_tokens, "total_tokens": head.input_tokens},
        })
