"""The OpenAI-compatible routes as codecs: ``/v1/chat/completions`` and ``/v1/completions``. Pure.

What OpenAI-compatible clients send works unchanged, within what one model of either mode can do:

    body ──parse──> Call (system/developer messages joined into the system prompt; text parts)
    Completion ──whole──> {id, object, created, model, choices: [one], usage}
    pieces ──stream──> data: {chunk}  ...  data: {chunk with finish_reason}  [data: {usage}]  data: [DONE]

The limits of ``/v1/messages`` hold here too; a field ferry does not do is refused with a 400
naming it rather than silently ignored (:mod:`gateway.wire.openai_request`). Overload
is **503** with ``Retry-After``, not Anthropic's 529: what OpenAI-compatible clients, proxies and
retry policies know as "try again later". The fields, defaults and statuses: docs/http-api.md."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gateway.wire import api
from gateway.wire.codec import Call, Head
from gateway.wire.limit_headers import openai as openai_limit_headers
from gateway.wire.openai_request import parse_chat, parse_completion

DONE = b"data: [DONE]\n\n"
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM do

# Anthropic's error type (gateway.wire.api.ERRORS) -> OpenAI's status, type and code.
ERRORS: dict[str, tuple[int | None, str, str | None]] = {
    "invalid_request_error": (None, "invalid_request_error", None),
    "authentication_error": (None, "invalid_request_error", "invalid_api_key"),
    "not_found_error": (None, "invalid_request_error", "model_not_found"),
    "request_too_large": (None, "invalid_request_error", "request_too_large"),
    "timeout_error": (None, "invalid_request_error", "request_timeout"),
    "rate_limit_error": (None, "rate_limit_error", "rate_limit_exceeded"),
    "overloaded_error": (503, "server_error", "overloaded"),
    "api_error": (None, "server_error", None),
}
_FIELD = re.compile(r"^([A-Za-z_][\w.]*): ")  # "messages.0.content: ..." names its field


def error_reply(kind: api.ErrorKind, message: str) -> tuple[int, bytes]:
    status, kind_type, code = ERRORS.get(kind.type, (None, "server_error", None))
    if code == "model_not_found" and not message.startswith("model:"):
        code = None  # an unknown route, not an unknown model
    field = _FIELD.match(message)
    error = {"message": message, "type": kind_type, "param": field.group(1) if field else None, "code": code}
    return status or kind.status, api.dumps({"error": error})


def error_response(error: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Status, ``{"error": {...}}`` body and headers; unknown errors say no more than that."""
    kind = api.error_kind(error)
    status, body = error_reply(kind, str(error) if kind is not api.INTERNAL else "internal error")
    headers = api.retry_after_headers(getattr(error, "retry_after", 1.0)) if kind.retry_after else {}
    return status, body, headers


def finish_reason(stop_reason: str, blocked: bool) -> str:
    if blocked or stop_reason == "refusal":
        return "content_filter"
    return "length" if stop_reason == "max_tokens" else "stop"


def model_info(name: str, created: int, context_window: int) -> dict[str, Any]:
    """``GET /v1/models/{id}`` in OpenAI's shape, with vLLM's ``max_model_len`` (the context window)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "ferry",
            "max_model_len": context_window}


def models_body(models: list[tuple[str, int]], created: int) -> dict[str, Any]:
    """``GET /v1/models`` in OpenAI's shape: each (name, context window) served."""
    return {"object": "list", "data": [model_info(name, created, window) for name, window in models]}


# --- Replies -------------------------------------------------------------------------------


class _Route:
    """What both routes share; each says how its body parses (``parse``, :mod:`gateway.wire.openai_request`),
    how its answer's text appears in a choice (``_answer``), and how its chunks do."""

    error_response = staticmethod(error_response)
    error_reply = staticmethod(error_reply)
    limit_headers = staticmethod(openai_limit_headers)
    object: str

    def __init__(self, call: Call, include_usage: bool) -> None:
        self.call = call
        self.include_usage = include_usage

    def whole(self, head: Head, completion: api.Completion, blocked: bool) -> bytes:
        choice = {"index": 0, **self._answer(completion.text), "logprobs": None,
                  "finish_reason": finish_reason(completion.stop_reason, blocked)}
        return api.dumps(
            {
                "id": head.request_id,
                "object": self.object,
                "created": head.created,
                "model": head.model,
                "choices": [choice],
                "usage": _usage(head, completion.output_tokens, completion.cached_tokens),
            }
        )

    @staticmethod
    def _answer(text: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatCompletions(_Route):
    """``POST /v1/chat/completions``."""

    idempotency_scope = "chat.completions:"
    object = "chat.completion"

    @classmethod
    def parse(cls, body: bytes) -> ChatCompletions:
        return cls(*parse_chat(body))

    @staticmethod
    def _answer(text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text, "refusal": None}}

    def stream(self, head: Head) -> Chunks:
        return Chunks(
            head,
            "chat.completion.chunk",
            self.include_usage,
            lambda text: {"delta": {"content": text}},
            opening={"delta": {"role": "assistant", "content": ""}},
            closing={"delta": {}},
        )


class Completions(_Route):
    """``POST /v1/completions`` (legacy): a raw prompt, no chat template."""

    idempotency_scope = "completions:"
    object = "text_completion"

    @classmethod
    def parse(cls, body: bytes) -> Completions:
        return cls(*parse_completion(body, DEFAULT_COMPLETION_TOKENS))

    @staticmethod
    def _answer(text: str) -> dict[str, Any]:
        return {"text": text}

    def stream(self, head: Head) -> Chunks:
        return Chunks(head, "text_completion", self.include_usage, lambda text: {"text": text},
                      opening=None, closing={"text": ""})


def _usage(head: Head, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage: the prompt's tokens, of them those the prefix cache supplied, the answer's."""
    return {"prompt_tokens": head.input_tokens, "completion_tokens": output_tokens,
            "total_tokens": head.input_tokens + output_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Chunks:
    """A streamed answer as ``data:`` chunks: an opening chunk (chat: the assistant's role),
    one per piece of text, one with the finish reason, the usage chunk (``choices: []``) when
    ``stream_options.include_usage`` asked for it, then ``[DONE]``. A failure after the headers
    is a ``data: {"error": ...}`` chunk (the SDK raises it as an ``APIError``), then ``[DONE]``."""

    ping = b": ping\n\n"  # an SSE comment: clients skip it, proxies see the stream is alive

    def __init__(self, head: Head, kind: str, include_usage: bool, piece: Callable[[str], dict[str, Any]],
                 opening: dict[str, Any] | None, closing: dict[str, Any]) -> None:
        self._head = head
        self._top = {"id": head.request_id, "object": kind, "created": head.created, "model": head.model}
        self._include_usage = include_usage
        self._opening = opening  # the first chunk's choice, if the route sends one
        self._closing = closing  # the last chunk's choice, beside its finish reason
        before, after = api.around(self._shape(piece(api.TEXT)))
        self._before, self._after = b"data: " + before, after + b"\n\n"  # a text chunk, less its text

    def start(self) -> bytes:
        return self._chunk(self._opening) if self._opening is not None else b""

    def text(self, text: str) -> bytes:
        return self._before + api.dumps(text) + self._after if text else b""

    def stop(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool,
             cached_tokens: int = 0) -> bytes:
        last = self._chunk(self._closing, finish_reason(stop_reason, blocked))
        if self._include_usage:
            usage = _usage(self._head, output_tokens, cached_tokens)
            last += _data({**self._top, "choices": [], "usage": usage})
        return last + DONE

    def error(self, error: BaseException) -> bytes:
        return b"data: " + error_response(error)[1] + b"\n\n" + DONE

    def _chunk(self, choice: dict[str, Any], finish: str | None = None) -> bytes:
        return _data(self._shape(choice, finish))

    def _shape(self, choice: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        data = {**self._top, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}]}
        if self._include_usage:
            data["usage"] = None
        return data


def _data(value: dict[str, Any]) -> bytes:
    return b"data: " + api.dumps(value) + b"\n\n"
