"""What every route's wire format shares: errors and their one table, a request's limits and
the checks of its fields, the whole answer. Pure: no I/O, so every rule is tested directly
(``tests/pure/test_api.py``) and the HTTP handlers stay thin. The routes' own codecs build on it:
:mod:`gateway.wire.anthropic` (``/v1/messages``) and :mod:`gateway.wire.openai`.

    any error ──error_response──> (status, {type:"error", error:{type, message}}, headers)
    a field ──required / checked_text / content_text / stop_list / at_most──> its value, or
                                                        InvalidRequest naming the field

:data:`ERRORS` is the one table from an error type to its HTTP status and API error type;
nothing else in the gateway picks a status for an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import msgspec

from batcher.core.errors import Overloaded, RequestFailed, TooLarge


class ApiError(Exception):
    """An error the client caused or must hear about; its class picks the status in ERRORS."""


class InvalidRequest(ApiError):
    """The body is malformed or breaks a rule; the message names the field."""


class UnreadableBody(InvalidRequest):
    """The body does not decode as its headers declare (a gzip body that is not): what follows
    it on the connection cannot be framed, so the connection closes after the answer."""


class AuthenticationFailed(ApiError):
    """No API key, or one the gateway does not know."""


class NotFound(ApiError):
    """No such model (or route)."""


class RequestTooLarge(ApiError):
    """The body is over the server's limit."""


def body_too_large(limit: int) -> RequestTooLarge:
    """The 413 of a body over ``limit`` bytes, whether its header said so or its bytes did."""
    return RequestTooLarge(f"body: over the limit of {limit} bytes")


class RequestTimeout(ApiError):
    """The body did not arrive within the server's ``body_timeout_ms`` of its headers."""


class Unavailable(ApiError):
    """The scheduling core is not running (starting, stopped, or crashed)."""


class ShuttingDown(Unavailable):
    """The server is stopping and this request was still waiting when its grace period ended."""


class RateLimited(ApiError):
    """The key's per-minute budget cannot cover this request now; ``retry_after`` says when."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorKind:
    status: int
    type: str
    retry_after: bool = False  # 429 and 529 tell the client when to try again


# The one table (docs/http-api.md, "Errors"). Order matters: the first class an error is an instance of wins.
ERRORS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (InvalidRequest, ErrorKind(400, "invalid_request_error")),
    (TooLarge, ErrorKind(400, "invalid_request_error")),  # over one replica's KV cache
    (AuthenticationFailed, ErrorKind(401, "authentication_error")),
    (NotFound, ErrorKind(404, "not_found_error")),
    (RequestTimeout, ErrorKind(408, "timeout_error")),
    (RequestTooLarge, ErrorKind(413, "request_too_large")),
    (RateLimited, ErrorKind(429, "rate_limit_error", retry_after=True)),
    (Overloaded, ErrorKind(529, "overloaded_error", retry_after=True)),
    (RequestFailed, ErrorKind(500, "api_error")),
    (ShuttingDown, ErrorKind(503, "overloaded_error", retry_after=True)),  # retry: another gateway, or soon
    (Unavailable, ErrorKind(500, "api_error")),
)
INTERNAL = ErrorKind(500, "api_error")


def error_kind(error: BaseException) -> ErrorKind:
    for cls, kind in ERRORS:
        if isinstance(error, cls):
            return kind
    return INTERNAL


def should_retry(error: BaseException) -> bool:
    """Whether the same request may well succeed if sent again (``x-should-retry``): overload, a
    rate limit, a late body, a core stopping or stopped; never a malformed request, an input
    that fails on its own (a handler says so from its ``Failed`` event) or an unexpected error."""
    return error_kind(error).retry_after or isinstance(error, RequestTimeout | Unavailable)


def kind_for_status(status: int) -> ErrorKind:
    """The kind of an error that arrives as a bare status (aiohttp's own 404, 405, 413...)."""
    for _, kind in ERRORS:
        if kind.status == status:
            return kind
    return ErrorKind(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(kind: ErrorKind, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind.type, "message": message}}


def error_response(error: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Status, JSON body and headers for an error; unknown errors say no more than that."""
    kind = error_kind(error)
    message = str(error) if kind is not INTERNAL else "internal error"
    headers = retry_after_headers(getattr(error, "retry_after", 1.0)) if kind.retry_after else {}
    return kind.status, dumps(error_body(kind, message)), headers


def error_reply(kind: ErrorKind, message: str) -> tuple[int, bytes]:
    """Status and body of an error known only by its kind (aiohttp's own 404, 405...)."""
    return kind.status, dumps(error_body(kind, message))


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (HTTP allows no fraction; rounded up, at least 1) and
    ``retry-after-ms`` with the estimate itself, which the Anthropic SDKs read first."""
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, round(seconds * 1000))),
    }


_ENCODER = msgspec.json.Encoder()


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8: the bytes ``json.dumps(value, ensure_ascii=False, separators=(",",
    ":")).encode()`` gave, a tenth of the time (experiments/docs/gateway-http.md; floats with
    an exponent aside, ``1e-07`` as ``1e-7``, which no API answer carries)."""
    return _ENCODER.encode(value)


TEXT = "\x00ferry:text\x00"
"""Stands for a piece of text in a shape given to :func:`around` (no API value holds a NUL)."""


def around(shape: Any) -> tuple[bytes, bytes]:
    """The bytes of ``dumps(shape)`` before and after the one :data:`TEXT` in it: a stream's
    chunk is then ``before + dumps(text) + after``, the same bytes as ``dumps`` of the whole,
    and only the text is encoded per chunk."""
    before, after = dumps(shape).split(dumps(TEXT))
    return before, after


# --- Requests ------------------------------------------------------------------------------

# What one request may carry (docs/http-api.md, "Errors"). msgspec reads the body in one pass in C
# (gateway/wire/typed.py), so a refusal costs no more than the body's own parse; the counts are
# checked next, and every later step of a request (checks, prompt, token count, stop-sequence cut)
# is linear in the body. The values:
# - 100,000 messages: the limit Anthropic's Messages API documents, so any request it takes fits.
# - 1,000 content blocks per message: Anthropic documents none for text; a client that splits a
#   turn into more blocks than that is not writing prose, and the body limit binds well before.
# - 16 stop sequences of at most 256 characters: OpenAI allows 4 and TGI 4 by default; Anthropic
#   documents no count, so 16 leaves its clients room while cutting an answer stays 16 scans of it.
#   256 characters keep the tail a stream must hold back (a stop sequence may be arriving) short.
# - 2,097,152 (2 Mi) characters of text in system and messages together: about half a million
#   tokens of English, past the context window of any model ferry serves; the default 4 MiB body
#   limit binds first for ASCII, this one when an operator raises it.
MAX_MESSAGES = 100_000
MAX_BLOCKS = 1_000
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TEXT_CHARS = 2 << 20


def stop_list(stops: list[str], where: str) -> tuple[str, ...]:
    """Stop sequences, checked: non-empty strings within the limits (every API's)."""
    if not stops:
        return ()  # most requests name none
    at_most(len(stops), MAX_STOP_SEQUENCES, where, "stop sequences per request")
    if any(not s for s in stops):
        raise InvalidRequest(f"{where}: expected non-empty strings, got an empty one")
    for index, stop in enumerate(stops):
        at_most(len(stop), MAX_STOP_CHARS, f"{where}.{index}", "characters in a stop sequence")
    return tuple(stops)


def at_most(count: int, limit: int, where: str, what: str) -> None:
    if count > limit:
        raise InvalidRequest(f"{where}: at most {limit:,} {what}, got {count:,}")


def required(table: dict[str, Any], name: str, where: str = "") -> Any:
    """``table[name]``, or :class:`InvalidRequest` naming the missing field."""
    if name not in table:
        raise InvalidRequest(f"{where + '.' if where else ''}{name}: field required")
    return table[name]


def checked_text(value: object, where: str) -> str:
    """A string that is valid Unicode, or :class:`InvalidRequest` naming ``where``."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: expected a string, got {json_type(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:  # JSON allows a lone surrogate ("\ud800"); UTF-8 does not
        raise InvalidRequest(f"{where}: expected valid Unicode text, got a lone surrogate") from None
    return value


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def show(value: object) -> str:
    return (
        short(json.dumps(value)) if isinstance(value, int | float | str | bool | None) else json_type(value)
    )


def short(value: object, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def context_overflow(input_tokens: int, max_tokens: int, context_window: int) -> InvalidRequest | None:
    """The error for a prompt that, with ``max_tokens`` to answer, would not fit the model."""
    if input_tokens + max_tokens <= context_window:
        return None
    return InvalidRequest(
        f"prompt is too long: {input_tokens} prompt tokens + max_tokens {max_tokens} = "
        f"{input_tokens + max_tokens} > {context_window}, the model's context window"
    )


def outside_vocabulary(logit_bias: tuple[tuple[int, float], ...], vocab_size: int) -> InvalidRequest | None:
    """The error for a ``logit_bias`` that names a token the model does not have (pairs by id)."""
    if not logit_bias or logit_bias[-1][0] < vocab_size:
        return None
    return InvalidRequest(
        f"logit_bias: token id {logit_bias[-1][0]} is not in this model's vocabulary of {vocab_size} tokens"
    )


# --- Responses -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """A whole answer as the client sees it (``gateway/text/answer.py`` builds it from events)."""

    text: str
    stop_reason: str  # "end_turn", "stop_sequence", "max_tokens" or "refusal"
    stop_sequence: str | None
    output_tokens: int
    cached_tokens: int = 0  # of the prompt's, those the prefix cache supplied
