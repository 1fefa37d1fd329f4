"""The Anthropic Messages API's wire format, and the ``/v1/messages`` route as a
:class:`~gateway.wire.codec.Codec`: pure codecs, built on what every route shares (:mod:`gateway.wire.api`).

    body bytes ──parse_message_request──> MessageRequest (the chat template renders its prompt)
    Completion ──message_body──> JSON;  text pieces ──stream_start / text_delta / stream_stop──> SSE

:class:`Messages` and :class:`MessageStream` hold the state a request and its stream need
(whether the text block is open yet); everything else here is a function of its arguments.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gateway.wire import api
from gateway.wire.api import (
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    Completion,
    InvalidRequest,
    at_most,
    checked_text,
    content_text,
    dumps,
    error_response,
    is_int,
    is_number,
    json_type,
    required,
    short,
    show,
    stop_list,
)
from gateway.wire.codec import Call, Head, asked

ROLES = ("user", "assistant")


@dataclasses.dataclass(frozen=True, slots=True)
class MessageRequest:
    """A checked ``POST /v1/messages`` body: the fields a model of either mode is served from."""

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


DROPPED_FIELDS = ("tools", "tool_choice", "thinking", "mcp_servers", "container")
"""Messages API fields whose meaning ferry would drop: refused (:func:`gateway.wire.api.refuse_dropped`)."""


def parse_message_request(body: bytes, counting: bool = False) -> MessageRequest:
    """Check a body; raise :class:`InvalidRequest` naming the first field that is wrong.

    ``temperature``, ``top_p`` and ``top_k`` pass to a continuous model's sampler (a fixed-mode
    worker's ``run_batch`` takes text alone, so they do not reach it); ``metadata.user_id`` keeps
    a user on one version of an alias; other ``metadata`` and unknown fields are accepted and
    ignored, but not the fields of :data:`DROPPED_FIELDS`. ``counting``: a ``count_tokens`` body,
    which has no ``max_tokens`` (1 stands in).
    """
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"body: expected a JSON object, got invalid JSON ({short(exc)})") from None
    if not isinstance(document, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {json_type(document)}")
    model = checked_text(required(document, "model"), "model")
    if not model:
        raise InvalidRequest("model: expected a model name, got an empty string")
    api.refuse_dropped(document, DROPPED_FIELDS)
    messages = required(document, "messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"messages: expected a non-empty array, got {json_type(messages)}")
    at_most(len(messages), MAX_MESSAGES, "messages", "messages per request")
    turns = tuple(_message(message, f"messages.{index}") for index, message in enumerate(messages))
    max_tokens = document.get("max_tokens", 1) if counting else required(document, "max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens: expected an integer >= 1, got {show(max_tokens)}")
    system = document.get("system")
    temperature = document.get("temperature")
    if temperature is not None and (not is_number(temperature) or not 0.0 <= temperature <= 1.0):
        raise InvalidRequest(f"temperature: expected a number in 0..1, got {show(temperature)}")
    top_p = document.get("top_p")
    if top_p is not None and (not is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p: expected a number in (0, 1], got {show(top_p)}")
    top_k = document.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise InvalidRequest(f"top_k: expected an integer >= 0, got {show(top_k)}")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream: expected a boolean, got {show(stream)}")
    stop_sequences = stop_list(document.get("stop_sequences", []), "stop_sequences")
    if not isinstance(document.get("metadata"), dict | None):
        raise InvalidRequest(f"metadata: expected an object, got {json_type(document['metadata'])}")
    user_id = (document.get("metadata") or {}).get("user_id")
    if user_id is not None:
        checked_text(user_id, "metadata.user_id")
    system_text = "" if system is None else content_text(system, "system")
    text_chars = len(system_text) + sum(len(text) for _, text in turns)
    at_most(text_chars, MAX_TEXT_CHARS, "messages", "characters of text in system and messages together")
    return MessageRequest(
        model=model,
        messages=turns,
        max_tokens=max_tokens,
        system=system_text,
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=top_k,
        stream=stream,
        stop_sequences=stop_sequences,
        user_id=user_id,
    )


def _message(message: object, where: str) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where}: expected an object with role and content, got {json_type(message)}")
    role = required(message, "role", where)
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role: expected one of {list(ROLES)}, got {show(role)}")
    return role, content_text(required(message, "content", where), f"{where}.content")



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
        "usage": {"input_tokens": input_tokens, "output_tokens": completion.output_tokens},
    }


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


def stream_stop(stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
    """The end of a stream, in the order the Messages API sends it: the text block's stop, the
    message's stop reason and output usage, then ``message_stop``."""
    stop = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    return b"".join(
        (
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse(
                "message_delta",
                {"type": "message_delta", "delta": stop, "usage": {"output_tokens": output_tokens}},
            ),
            sse("message_stop", {"type": "message_stop"}),
        )
    )


def stream_error(error: BaseException) -> bytes:
    """The ``error`` event that ends a stream whose headers are already sent."""
    _, body, _ = error_response(error)
    return b"event: error\ndata: " + body + b"\n\n"


def models_body(names: list[str], created_at: str) -> dict[str, Any]:
    """``GET /v1/models``: one entry per served version (aliases resolve to these)."""
    data = [{"type": "model", "id": name, "display_name": name, "created_at": created_at} for name in names]
    return {"data": data, "has_more": False, "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None}


class Messages:
    """``POST /v1/messages``."""

    id_prefix = "msg_"
    idempotency_scope = ""  # the first route: its keys keep the scope they always had
    error_response = staticmethod(api.error_response)
    error_reply = staticmethod(api.error_reply)

    def __init__(self, request: MessageRequest) -> None:
        self.request = request
        sampling = asked(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        self.call = Call(request.model, request.max_tokens, request.system, request.messages,
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

    def stop(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool) -> bytes:
        return self._open() + stream_stop(stop_reason or "end_turn", stop_sequence, output_tokens)

    def error(self, error: BaseException) -> bytes:
        return stream_error(error)

    def _open(self) -> bytes:
        if self._block:
            return b""
        self._block = True
        return BLOCK_START
