"""The Anthropic Messages API's wire format, and the ``/v1/messages`` route as a
:class:`~gateway.wire.codec.Codec`: pure codecs, built on what every route shares (:mod:`gateway.wire.api`).

    body bytes ──parse_message_request──> MessageRequest (the chat template renders its prompt)
    Completion ──message_body──> JSON;  text pieces ──stream_start / text_delta / stream_stop──> SSE

:class:`Messages` and :class:`MessageStream` hold the state a request and its stream need
(whether the text block is open yet); everything else here is a function of its arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from gateway.wire import api, typed
from gateway.wire.api import (
    MAX_BLOCKS,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    Completion,
    InvalidRequest,
    at_most,
    dumps,
    error_response,
    show,
    stop_list,
)
from gateway.wire.codec import Call, Head, asked
from gateway.wire.limit_headers import anthropic as anthropic_limit_headers
from gateway.wire.typed import Fields

ROLES = ("user", "assistant")


@dataclasses.dataclass(frozen=True, slots=True)
class MessageRequest:
    """A checked ``POST /v1/messages`` body: the fields a model of either mode is served from.
    ``messages`` are its turns, consecutive messages of one role merged into one turn; a last
    turn of the assistant is a prefill, which the answer continues."""

    model: str
    messages: tuple[tuple[str, str], ...]  # (role, text), text blocks joined
    max_tokens: int
    system: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()
    user_id: str | None = None  # metadata.user_id: the session an alias's split keeps together

    @property
    def prefill(self) -> bool:
        return self.messages[-1][0] == "assistant"


class CacheControl(Fields, frozen=True):
    """A prompt-cache breakpoint: honoured as it stands, ferry caches every prompt's prefix."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Fields, tag="text", tag_field="type", frozen=True):
    text: str
    cache_control: CacheControl | None = None
    citations: object = None  # refused when used: ferry's models cite nothing


Content = str | list[TextBlock]


class Message(Fields, frozen=True):
    role: Literal["user", "assistant"]
    content: Content


class Metadata(Fields, frozen=True):
    user_id: str | None = None


class Body(Fields, frozen=True):
    """Every field of a Messages API request (the SDK's ``MessageCreateParams`` and vLLM's
    ``top_k``); docs/http-api.md says what ferry does with each."""

    model: str
    messages: list[Message]
    max_tokens: int | None = None  # required but for count_tokens: checked after
    system: Content | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # ferry has one capacity: both hold
    speed: Literal["standard", "fast"] | None = None
    tools: object = None
    tool_choice: object = None
    thinking: object = None
    mcp_servers: object = None
    container: object = None
    output_config: object = None
    diagnostics: object = None
    inference_geo: object = None
    user_profile_id: object = None
    workspace_id: object = None


DROPPED_FIELDS = ("tools", "tool_choice", "thinking", "mcp_servers", "container", "output_config",
                  "diagnostics", "inference_geo", "user_profile_id", "workspace_id")
"""Messages API fields whose meaning ferry would drop: refused by name unless they say "not used"
(:func:`gateway.wire.typed.refuse_used`)."""


def _blocks(value: object) -> str:
    return f"{show(value)} blocks are not supported by this server; its models read 'text' blocks only"


EXPECTED: typed.Expected = {
    "messages": "a non-empty array",
    "messages.*": "an object with role and content",
    "messages.*.role": f"one of {list(ROLES)}",
    "messages.*.content": "a string or an array of text blocks",
    "messages.*.content.*": "a content block object",
    "messages.*.content.*.type": _blocks,
    "system": "a string or an array of text blocks",
    "system.*": "a content block object",
    "system.*.type": _blocks,
    "max_tokens": "an integer >= 1",
    "temperature": "a number in 0..1",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 0",
    "stream": "a boolean",
    "stop_sequences": "an array of strings",
    "metadata": "an object",
    "speed": "'standard' or 'fast'",
}
_DECODER = msgspec.json.Decoder(Body)


def parse_message_request(body: bytes, counting: bool = False) -> MessageRequest:
    """Check a body; raise :class:`InvalidRequest` naming the first field that is wrong.

    ``temperature``, ``top_p`` and ``top_k`` pass to a continuous model's sampler (a fixed-mode
    worker's ``run_batch`` takes text alone, so they do not reach it); ``metadata.user_id`` keeps
    a user on one version of an alias. A field the API does not have, or one of
    :data:`DROPPED_FIELDS` used, is refused by name. ``counting``: a ``count_tokens`` body, which
    has no ``max_tokens`` (1 stands in).
    """
    fields: Body = typed.decode(_DECODER, body, EXPECTED)
    if not fields.model:
        raise InvalidRequest("model: expected a model name, got an empty string")
    typed.refuse_used(fields, DROPPED_FIELDS)
    if fields.speed == "fast":
        raise InvalidRequest('speed: not supported by this server, got "fast"')
    if not fields.messages:
        raise InvalidRequest("messages: expected a non-empty array, got an array")
    at_most(len(fields.messages), MAX_MESSAGES, "messages", "messages per request")
    if fields.max_tokens is None and not counting:
        raise InvalidRequest("max_tokens: field required")
    max_tokens = 1 if fields.max_tokens is None else fields.max_tokens
    _check("max_tokens", max_tokens, lambda n: n >= 1)
    _check("temperature", fields.temperature, lambda t: 0.0 <= t <= 1.0)
    _check("top_p", fields.top_p, lambda p: 0.0 < p <= 1.0)
    _check("top_k", fields.top_k, lambda k: k >= 0)
    turns = _turns(fields.messages)
    system = "" if fields.system is None else _text(fields.system, "system")
    text_chars = len(system) + sum(len(text) for _, text in turns)
    at_most(text_chars, MAX_TEXT_CHARS, "messages", "characters of text in system and messages together")
    return MessageRequest(
        model=fields.model,
        messages=turns,
        max_tokens=max_tokens,
        system=system,
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        stream=fields.stream,
        stop_sequences=stop_list(fields.stop_sequences or [], "stop_sequences"),
        user_id=None if fields.metadata is None else fields.metadata.user_id,
    )


def _check(name: str, value: object, holds: Callable[[Any], bool]) -> None:
    """A value, if given, in its range, or the 400 that says the range."""
    if value is not None and not holds(value):
        raise InvalidRequest(f"{name}: expected {EXPECTED[name]}, got {show(value)}")


def _turns(messages: list[Message]) -> tuple[tuple[str, str], ...]:
    """The conversation's turns: consecutive messages of one role are one turn, as the API merges
    them (their texts joined as one message's blocks are); a last assistant turn is a prefill,
    which may not end with whitespace (the API's own rule: the answer continues it)."""
    turns: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        text = _text(message.content, f"messages.{index}.content")
        if turns and turns[-1][0] == message.role:
            turns[-1] = (message.role, turns[-1][1] + text)
        else:
            turns.append((message.role, text))
    role, last = turns[-1]
    if role == "assistant" and last != last.rstrip():
        raise InvalidRequest(
            f"messages.{len(messages) - 1}.content: the final assistant content (a prefill) cannot end "
            "with whitespace"
        )
    return tuple(turns)


def _text(content: Content, where: str) -> str:
    """A string, or its text blocks joined (a block's citations refused: ferry cites nothing)."""
    if isinstance(content, str):
        return content
    at_most(len(content), MAX_BLOCKS, where, "content blocks")
    for index, block in enumerate(content):
        if not typed.unused(block.citations):
            raise InvalidRequest(f"{where}.{index}.citations: not supported by this server")
    return "".join(block.text for block in content)


# --- Responses -----------------------------------------------------------------------------


def message_body(message_id: str, model: str, completion: Completion, input_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) response."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": completion.text}],
        "stop_reason": completion.stop_reason,
        "stop_sequence": completion.stop_sequence,
        "usage": usage(input_tokens, completion.cached_tokens, completion.output_tokens),
    }


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """The API's usage: ``input_tokens`` are those read neither from nor into a cache, so the
    prompt is their sum with ``cache_read_input_tokens`` (what the prefix cache supplied) and
    ``cache_creation_input_tokens`` (0: writing the cache costs nothing more here)."""
    return {"input_tokens": input_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``event:`` line, one ``data:`` line of JSON, a blank line."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"


PING = sse("ping", {"type": "ping"})


def stream_start(message_id: str, model: str, input_tokens: int) -> bytes:
    """``message_start``: the message with no content yet, and the prompt's usage."""
    message = message_body(message_id, model, Completion("", "", None, 0), input_tokens)
    message.update(content=[], stop_reason=None, stop_sequence=None)
    return sse("message_start", {"type": "message_start", "message": message})


BLOCK_START = sse("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})


_DELTA = api.around(
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": api.TEXT}}
)
_DELTA_HEAD, _DELTA_TAIL = b"event: content_block_delta\ndata: " + _DELTA[0], _DELTA[1] + b"\n\n"


def text_delta(text: str) -> bytes:
    """``content_block_delta``: more text of the answer's one text block (only the text is
    encoded per chunk: :func:`gateway.wire.api.around`)."""
    return _DELTA_HEAD + dumps(text) + _DELTA_TAIL


def stream_stop(stop_reason: str, stop_sequence: str | None, tokens: dict[str, int]) -> bytes:
    """The end of a stream, in the order the Messages API sends it: the text block's stop, the
    message's stop reason and its whole usage (:func:`usage`: the prefix cache's share is known
    only now), then ``message_stop``."""
    stop = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    return b"".join(
        (
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse("message_delta", {"type": "message_delta", "delta": stop, "usage": tokens}),
            sse("message_stop", {"type": "message_stop"}),
        )
    )


def stream_error(error: BaseException) -> bytes:
    """The ``error`` event that ends a stream whose headers are already sent."""
    _, body, _ = error_response(error)
    return b"event: error\ndata: " + body + b"\n\n"


def model_info(name: str, created_at: str, context_window: int) -> dict[str, Any]:
    """``GET /v1/models/{id}``: one model. A prompt and its ``max_tokens`` share the context
    window, so each alone may take all of it but one token."""
    return {"type": "model", "id": name, "display_name": name, "created_at": created_at,
            "max_input_tokens": context_window - 1, "max_tokens": context_window - 1}


def models_body(models: list[tuple[str, int]], created_at: str) -> dict[str, Any]:
    """``GET /v1/models``: each (name, context window) served, versions and aliases."""
    data = [model_info(name, created_at, window) for name, window in models]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


class Messages:
    """``POST /v1/messages``."""

    idempotency_scope = ""  # the first route: its keys keep the scope they always had
    error_response = staticmethod(api.error_response)
    error_reply = staticmethod(api.error_reply)
    limit_headers = staticmethod(anthropic_limit_headers)

    def __init__(self, request: MessageRequest) -> None:
        self.request = request
        sampling = asked(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        self.call = Call(request.model, request.max_tokens, request.system, request.messages, request.prefill,
                         sampling=sampling, stream=request.stream, stop_sequences=request.stop_sequences,
                         session=request.user_id)

    @classmethod
    def parse(cls, body: bytes) -> Messages:
        return cls(parse_message_request(body))

    def whole(self, head: Head, completion: Completion, blocked: bool) -> bytes:
        return dumps(message_body(head.request_id, head.model, completion, head.input_tokens))

    def stream(self, head: Head) -> MessageStream:
        return MessageStream(head)


class MessageStream:
    """``message_start``, the text block opened with its first text (or at the end, empty),
    deltas, then the stop events, or an ``error`` event."""

    ping = PING

    def __init__(self, head: Head) -> None:
        self._head = head
        self._block = False  # content_block_start sent

    def start(self) -> bytes:
        return stream_start(self._head.request_id, self._head.model, self._head.input_tokens)

    def text(self, text: str) -> bytes:
        return self._open() + text_delta(text) if text else b""

    def stop(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool,
             cached_tokens: int = 0) -> bytes:
        tokens = usage(self._head.input_tokens, cached_tokens, output_tokens)
        return self._open() + stream_stop(stop_reason or "end_turn", stop_sequence, tokens)

    def error(self, error: BaseException) -> bytes:
        return stream_error(error)

    def _open(self) -> bytes:
        if self._block:
            return b""
        self._block = True
        return BLOCK_START
