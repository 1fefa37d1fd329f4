"""The OpenAI-compatible routes as codecs: ``/v1/chat/completions`` and ``/v1/completions``. Pure.

What OpenAI-compatible clients send works unchanged, within what one model of either mode can do:

    body ──parse──> Call (system/developer messages joined into the system prompt; text parts)
    Completion ──whole──> {id, object, created, model, choices: [one], usage}
    pieces ──stream──> data: {chunk}  ...  data: {chunk with finish_reason}  [data: {usage}]  data: [DONE]

The limits of ``/v1/messages`` hold here too; a field whose meaning ferry would drop
(:data:`DROPPED_FIELDS`) is refused with a 400 naming it rather than silently ignored. Overload
is **503** with ``Retry-After``, not Anthropic's 529: what OpenAI-compatible clients, proxies and
retry policies know as "try again later". The fields, defaults and statuses: docs/http-api.md."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from gateway.wire import api
from gateway.wire.api import (
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    InvalidRequest,
    at_most,
    checked_text,
    content_text,
    is_int,
    is_number,
    json_type,
    required,
    short,
    show,
)
from gateway.wire.codec import Call, Head, asked

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


def models_body(names: list[str], created: int) -> dict[str, Any]:
    """``GET /v1/models`` in OpenAI's shape."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "ferry"} for name in names],
    }


# --- Requests ------------------------------------------------------------------------------

DROPPED_FIELDS = ("tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs", "audio",
                  "suffix", "echo", "response_format", "prediction", "web_search_options")


def _document(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"body: expected a JSON object, got invalid JSON ({short(exc)})") from None
    if not isinstance(document, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {json_type(document)}")
    return document


def _count(document: dict, name: str) -> int | None:
    value = document.get(name)
    if value is not None and (not is_int(value) or value < 1):
        raise InvalidRequest(f"{name}: expected an integer >= 1, got {show(value)}")
    return value


def _common(document: dict, default_max_tokens: int | None) -> dict[str, Any]:
    """The fields both routes share, checked: model, limits, sampling, stops, stream, user."""
    model = checked_text(required(document, "model"), "model")
    if not model:
        raise InvalidRequest("model: expected a model name, got an empty string")
    api.refuse_dropped(document, DROPPED_FIELDS)
    for name in ("n", "best_of"):
        if (_count(document, name) or 1) != 1:
            raise InvalidRequest(f"{name}: only 1 choice per request is supported, got {document[name]}")
    limit = _count(document, "max_completion_tokens") or _count(document, "max_tokens") or default_max_tokens
    temperature, top_p, seed = (document.get(name) for name in ("temperature", "top_p", "seed"))
    if temperature is not None and (not is_number(temperature) or not 0.0 <= temperature <= 2.0):
        raise InvalidRequest(f"temperature: expected a number in 0..2, got {show(temperature)}")
    if top_p is not None and (not is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p: expected a number in (0, 1], got {show(top_p)}")
    if seed is not None and not is_int(seed):
        raise InvalidRequest(f"seed: expected an integer, got {show(seed)}")
    stream = document.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream: expected a boolean, got {show(stream)}")
    user = document.get("user")
    return {
        "model": model, "max_tokens": limit, "stream": stream, "stop_sequences": _stops(document.get("stop")),
        "sampling": asked(temperature=None if temperature is None else float(temperature),
                          top_p=None if top_p is None else float(top_p), seed=seed),
        "session": None if user is None else checked_text(user, "user"),
    }


def _stops(stop: object) -> tuple[str, ...]:
    """OpenAI's ``stop``: none, one string, or a list, under the same rules as Anthropic's."""
    if stop is None:
        return ()
    return api.stop_list([stop] if isinstance(stop, str) else stop, "stop", "a string or an array of strings")


def _include_usage(document: dict, stream: bool) -> bool:
    options = document.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options: only allowed when stream is true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest(f"stream_options: expected {{include_usage: boolean}}, got {show(options)}")
    return options.get("include_usage", False)


def _chat_turns(messages: object) -> tuple[str, tuple[tuple[str, str], ...]]:
    """System and developer messages joined (one system prompt), then the user/assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"messages: expected a non-empty array, got {json_type(messages)}")
    at_most(len(messages), MAX_MESSAGES, "messages", "messages per request")
    system, turns = [], []
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise InvalidRequest(
                f"{where}: expected an object with role and content, got {json_type(message)}"
            )
        role = required(message, "role", where)
        if role not in ("system", "developer", "user", "assistant"):
            raise InvalidRequest(
                f"{where}.role: expected one of system, developer, user, assistant, got {show(role)}"
            )
        text = content_text(required(message, "content", where), f"{where}.content")
        if role in ("system", "developer"):
            system.append(text)
        else:
            turns.append((role, text))
    text_chars = sum(map(len, system)) + sum(len(text) for _, text in turns)
    at_most(text_chars, MAX_TEXT_CHARS, "messages", "characters of text in system and messages together")
    return "\n\n".join(system), tuple(turns)


def _prompt(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    elif isinstance(prompt, list):
        raise InvalidRequest("prompt: expected one string (several prompts, or token ids, are not supported)")
    text = checked_text(prompt, "prompt")
    at_most(len(text), MAX_TEXT_CHARS, "prompt", "characters of text")
    return text


# --- Replies -------------------------------------------------------------------------------


class _Route:
    """What both routes share; each says what its request adds to the common fields (its
    ``_input``), how its answer's text appears in a choice (``_answer``), and how its chunks do."""

    error_response = staticmethod(error_response)
    error_reply = staticmethod(error_reply)
    object: str
    default_max_tokens: int | None

    def __init__(self, call: Call, include_usage: bool) -> None:
        self.call = call
        self.include_usage = include_usage

    @classmethod
    def parse(cls, body: bytes) -> _Route:
        document = _document(body)
        fields = _common(document, cls.default_max_tokens)
        return cls(Call(**fields, **cls._input(document)), _include_usage(document, fields["stream"]))

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
                "usage": _usage(head, completion.output_tokens),
            }
        )

    @staticmethod
    def _input(document: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _answer(text: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatCompletions(_Route):
    """``POST /v1/chat/completions``."""

    id_prefix = "chatcmpl-"
    idempotency_scope = "chat.completions:"
    object = "chat.completion"
    default_max_tokens = None  # the rest of the context window

    @staticmethod
    def _input(document: dict[str, Any]) -> dict[str, Any]:
        system, turns = _chat_turns(required(document, "messages"))
        return {"system": system, "turns": turns}

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

    id_prefix = "cmpl-"
    idempotency_scope = "completions:"
    object = "text_completion"
    default_max_tokens = DEFAULT_COMPLETION_TOKENS

    @staticmethod
    def _input(document: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": _prompt(required(document, "prompt"))}

    @staticmethod
    def _answer(text: str) -> dict[str, Any]:
        return {"text": text}

    def stream(self, head: Head) -> Chunks:
        return Chunks(head, "text_completion", self.include_usage, lambda text: {"text": text},
                      opening=None, closing={"text": ""})


def _usage(head: Head, output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": head.input_tokens, "completion_tokens": output_tokens,
            "total_tokens": head.input_tokens + output_tokens}


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

    def stop(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool) -> bytes:
        last = self._chunk(self._closing, finish_reason(stop_reason, blocked))
        if self._include_usage:
            last += _data({**self._top, "choices": [], "usage": _usage(self._head, output_tokens)})
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
