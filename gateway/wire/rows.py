"""What the routes whose every input is a job of its own share: pure.

``POST /v1/embeddings`` (:mod:`gateway.wire.embeddings`) and the Open Inference Protocol's
``infer`` (:mod:`gateway.wire.oip`) carry many inputs in one request. Each input enters the
batcher as its own job, so the inputs of many clients share batches, and the answer waits for
all of them (``gateway/http/rows.py``). Only this differs between the two::

    body bytes ──Rows.parse──> model, inputs (checked: count, text, characters)
    the model's table ──Rows.fits──> InvalidRequest if this route cannot serve it
    each input's output (a text, or a float32 vector) ──Rows.whole──> JSON
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np

from batcher.core.config import Outputs
from gateway.wire.api import (
    MAX_TEXT_CHARS,
    InvalidRequest,
    at_most,
    checked_text,
    json_type,
    short,
)
from gateway.wire.codec import ErrorReply, ErrorResponse, Head, LimitHeaders

# Inputs in one request: OpenAI's limit for /v1/embeddings (2,048), kept for every route of this
# kind; each is a job, so a request costs at most this many queue entries. Their text together
# is held to the limit of the chat routes (MAX_TEXT_CHARS), and each input to the model's window.
MAX_ROWS = 2048


class Rows(Protocol):
    """One parsed request of a route whose inputs are jobs of their own."""

    id_prefix: str
    idempotency_scope: str
    model: str
    inputs: tuple[str, ...]
    session: str | None

    @classmethod
    def parse(cls, body: bytes, model: str | None) -> Rows:
        """Check a body (``model``: named by the URL, if the route's URL names it)."""

    def fits(self, name: str, outputs: Outputs, mode: str) -> None:
        """Raise :class:`InvalidRequest` if this route cannot serve model ``name``."""

    def whole(self, head: Head, answers: Sequence[str] | Sequence[bytes]) -> bytes:
        """The JSON body of the answer: one output per input, in order."""

    error_response: ErrorResponse  # an error in the route's shape, read from the class
    error_reply: ErrorReply

    @property
    def limit_headers(self) -> LimitHeaders | None:
        """The route's rate-limit headers, if it has any."""


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the 400 that says what it is instead."""
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"body: expected a JSON object, got invalid JSON ({short(exc)})") from None
    if not isinstance(document, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {json_type(document)}")
    return document


def texts(values: list, where: str) -> tuple[str, ...]:
    """A request's inputs, checked: 1..MAX_ROWS non-empty strings, within the text limit, each
    checked only once the count is known to be within its limit."""
    if not values:
        raise InvalidRequest(f"{where}: expected at least one input, got none")
    at_most(len(values), MAX_ROWS, where, "inputs per request")
    inputs = tuple(checked_text(value, f"{where}.{index}") for index, value in enumerate(values))
    empty = next((index for index, text in enumerate(inputs) if not text), None)
    if empty is not None:
        raise InvalidRequest(f"{where}.{empty}: expected a non-empty string")
    at_most(sum(map(len, inputs)), MAX_TEXT_CHARS, where, "characters of text in all inputs together")
    return inputs


def vectors(answers: Sequence[str] | Sequence[bytes], dimensions: int | None) -> np.ndarray:
    """The outputs of an embedding model as one float32 array, a row per input; ``dimensions``:
    each cut to its first N values and re-normalised (a Matryoshka model's shorter embedding)."""
    packed = [answer for answer in answers if isinstance(answer, bytes)]
    assert len(packed) == len(answers), "an embedding model's outputs are vectors (the pool checks them)"
    array = np.frombuffer(b"".join(packed), dtype="<f4").reshape(len(packed), -1)
    if dimensions is None or dimensions == array.shape[1]:
        return array
    short_rows = array[:, :dimensions]
    norms = np.linalg.norm(short_rows, axis=1, keepdims=True)
    return (short_rows / np.where(norms > 0, norms, 1)).astype("<f4")
