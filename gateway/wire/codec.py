"""What the request path needs from an API's wire format: one interface, several codecs.

The Anthropic Messages route (:mod:`gateway.wire.anthropic`) and the OpenAI-compatible routes
(:mod:`gateway.wire.openai`) share everything between the bytes in and the bytes out
(``gateway/http/app.py``). Only this differs::

    body bytes ──Codec.parse──> Call ── the shared path ──> Completion ──codec.whole──> JSON
                                                     └──> events ──codec.stream(...)──> SSE bytes
    any error ──Codec.error_response──> (status, body, headers) in the route's error shape

Codecs are pure: no I/O, no clock (the reply's ``created`` time comes in a :class:`Head`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from batcher.core.backend import Sampling
from gateway.wire.api import Completion, ErrorKind
from gateway.wire.limit_headers import Levels, Plan

Turn = tuple[str, str]  # (role, text)


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A checked request, whatever API it came in by."""

    model: str
    max_tokens: int | None  # None: the model's default_max_tokens, within its context window
    system: str = ""
    turns: tuple[Turn, ...] = ()
    prefill: bool = False  # the last turn is the assistant's, which the answer continues
    prompt: str | None = None  # a raw prompt (legacy completions): no chat template
    sampling: Sampling = Sampling()  # its max_tokens is set once ``max_tokens`` is known (the app's)
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()
    session: str | None = None  # what keeps a user on one version of an alias (gateway.ops.routing)


def asked(**fields: object) -> Sampling:
    """The sampling a request asked for: the ``fields`` it named (None: not named, the default)."""
    named = {name: value for name, value in fields.items() if value is not None}
    return Sampling(**named)  # type: ignore[arg-type]  # Sampling's own fields, each of its type


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """What every reply to one request names: its id, the version that answers, the prompt's
    tokens, and when it was created (Unix seconds)."""

    request_id: str
    model: str
    input_tokens: int
    created: int


class Stream(Protocol):
    """The bytes of one streamed answer, in order: ``start`` once (with the headers), then
    ``ping`` while waiting, ``text`` per piece released, and ``stop`` or ``error`` to end."""

    ping: bytes

    def start(self) -> bytes: ...

    def text(self, text: str) -> bytes: ...

    def stop(
        self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool,
        cached_tokens: int = 0,
    ) -> bytes: ...

    def error(self, error: BaseException) -> bytes: ...


class ErrorResponse(Protocol):
    def __call__(self, error: BaseException) -> tuple[int, bytes, dict[str, str]]:
        """Status, body and headers of an error in a route's shape."""


class ErrorReply(Protocol):
    def __call__(self, kind: ErrorKind, message: str) -> tuple[int, bytes]:
        """Status and body of an error known only by its kind (aiohttp's own 404, 405...)."""


class LimitHeaders(Protocol):
    def __call__(self, plan: Plan, levels: Levels, now: float | None = None) -> dict[str, str]:
        """The route's rate-limit headers for a key's plan and its buckets' levels (``now``: Unix
        seconds the resets are dated from, the clock's if None)."""


class ErrorShape(Protocol):
    """What a route's errors are written with: every codec's, and the error middleware's."""

    error_response: ErrorResponse
    error_reply: ErrorReply


class Codec(Protocol):
    """One route's wire format, as one parsed request. Its class attributes and static methods
    (``error_response = staticmethod(...)``) are declared as attributes: what a type checker
    matches a class's assignments against."""

    idempotency_scope: str  # an Idempotency-Key is scoped to the API key and this
    call: Call
    error_response: ErrorResponse  # an error in this route's shape, read from the class
    error_reply: ErrorReply
    limit_headers: LimitHeaders

    @classmethod
    def parse(cls, body: bytes) -> Codec:
        """Check a body; ``InvalidRequest`` names the first field that is wrong."""

    def whole(self, head: Head, completion: Completion, blocked: bool) -> bytes:
        """The JSON body of a whole answer (``blocked``: the safety stage replaced it)."""

    def stream(self, head: Head) -> Stream:
        """The encoder of a streamed answer."""
