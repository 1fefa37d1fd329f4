"""The OpenAI-compatible routes' request bodies, typed, and their checks: pure.

    body ──decode (msgspec, gateway.wire.typed)──> ChatBody | CompletionBody ──checks──> Call

Every field of the SDK's ``CompletionCreateParams`` (chat and legacy) is declared, with vLLM's
``top_k``, ``min_p`` and ``repetition_penalty``, which its users send in ``extra_body``: one ferry
does is honoured, one it would drop is refused by name when used (:data:`DROPPED_FIELDS`), and
any other field is refused as unknown. The table of what each does: docs/http-api.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from gateway.wire import api, typed
from gateway.wire.api import MAX_MESSAGES, MAX_TEXT_CHARS, InvalidRequest, at_most, show
from gateway.wire.codec import Call, asked
from gateway.wire.typed import Fields

MAX_LOGIT_BIAS = 300  # entries: each costs the engine a scatter per step; OpenAI documents none


class TextPart(Fields, tag="text", tag_field="type", frozen=True):
    text: str


Content = str | list[TextPart]


class ChatMessage(Fields, frozen=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: object = None
    refusal: object = None
    tool_calls: object = None
    function_call: object = None
    audio: object = None


class StreamOptions(Fields, frozen=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ferry adds no obfuscation: true is refused


class Sampled(Fields, frozen=True):
    """The fields both routes share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: object = None
    top_k: int | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    repetition_penalty: float | None = None  # vLLM's


class ChatBody(Sampled, kw_only=True, frozen=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    safety_identifier: str | None = None  # the session, as `user` (its successor)
    prompt_cache_key: str | None = None  # honoured as it stands: every prompt's prefix is cached
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    top_logprobs: object = None
    tools: object = None
    functions: object = None
    tool_choice: object = None
    function_call: object = None
    parallel_tool_calls: object = None
    audio: object = None
    prediction: object = None
    web_search_options: object = None
    response_format: object = None
    reasoning_effort: object = None
    verbosity: object = None
    moderation: object = None
    store: object = None
    metadata: object = None
    prompt_cache_options: object = None


class CompletionBody(Sampled, kw_only=True, frozen=True):
    prompt: str | list[object]
    best_of: int | None = None
    echo: object = None
    suffix: object = None


DROPPED_FIELDS = ("logprobs", "top_logprobs", "tools", "functions", "tool_choice", "function_call",
                  "parallel_tool_calls", "audio", "prediction", "web_search_options", "response_format",
                  "reasoning_effort", "verbosity", "moderation", "store", "metadata", "prompt_cache_options",
                  "echo", "suffix")
"""Fields whose meaning ferry would drop: refused by name unless they say "not used"."""
_DROPPED: dict[type[Sampled], tuple[str, ...]] = {
    body: tuple(name for name in DROPPED_FIELDS if name in body.__struct_fields__)
    for body in (ChatBody, CompletionBody)
}
MESSAGE_DROPPED = ("name", "refusal", "tool_calls", "function_call", "audio")
ONLY = {"prompt_cache_retention": ("in_memory",), "service_tier": ("auto", "default")}
"""Fields of which ferry does only these values (one cache, one capacity); others are refused."""


def _parts(value: object) -> str:
    return f"{show(value)} parts are not supported by this server; its models read 'text' parts only"


EXPECTED: typed.Expected = {
    "messages": "a non-empty array",
    "messages.*": "an object with role and content",
    "messages.*.role": "one of system, developer, user, assistant",
    "messages.*.content": "a string or an array of text parts",
    "messages.*.content.*": "a content part object",
    "messages.*.content.*.type": _parts,
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "n": "an integer >= 1",
    "best_of": "an integer >= 1",
    "temperature": "a number in 0..2",
    "top_p": "a number in (0, 1]",
    "stop": "a string or an array of strings",
    "stream": "a boolean",
    "stream_options": "an object {include_usage: boolean}",
    "presence_penalty": "a number in -2..2",
    "frequency_penalty": "a number in -2..2",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids to biases in -100..100",
    "top_k": "an integer >= -1 (0 or -1: off)",
    "min_p": "a number in 0..1",
    "repetition_penalty": "a number in (0, 2]",
    "prompt": "one string (several prompts, or token ids, are not supported)",
    "modalities": "['text']",
}
_CHAT = msgspec.json.Decoder(ChatBody)
_COMPLETION = msgspec.json.Decoder(CompletionBody)


def parse_chat(body: bytes) -> tuple[Call, bool]:
    """A ``/v1/chat/completions`` body as a :class:`Call`, and whether its stream ends with usage.
    ``max_tokens`` None: the model's ``default_max_tokens`` (the app's)."""
    fields: ChatBody = typed.decode(_CHAT, body, EXPECTED)
    common = _common(fields)
    if fields.modalities is not None and fields.modalities != ["text"]:
        raise InvalidRequest(f"modalities: not supported by this server, got {fields.modalities}")
    max_tokens = common.pop("max_tokens")  # the newer wins, as in vLLM
    limit = _count("max_completion_tokens", fields.max_completion_tokens) or max_tokens
    system, turns = _chat_turns(fields.messages)
    session = fields.user if fields.user is not None else fields.safety_identifier
    return Call(**common, max_tokens=limit, system=system, turns=turns, session=session), _usage(fields)


def parse_completion(body: bytes, default_max_tokens: int) -> tuple[Call, bool]:
    """A legacy ``/v1/completions`` body: one prompt, sent as it is (no chat template)."""
    fields: CompletionBody = typed.decode(_COMPLETION, body, EXPECTED)
    common = _common(fields)
    if (_count("best_of", fields.best_of) or 1) != 1:
        raise InvalidRequest(f"best_of: only 1 choice per request is supported, got {fields.best_of}")
    common["max_tokens"] = common["max_tokens"] or default_max_tokens
    return Call(**common, prompt=_prompt(fields.prompt), session=fields.user), _usage(fields)


def _common(fields: Sampled) -> dict[str, Any]:
    """The fields both routes share, checked: model, limits, sampling, stops, stream."""
    if not fields.model:
        raise InvalidRequest("model: expected a model name, got an empty string")
    typed.refuse_used(fields, _DROPPED[type(fields)])
    for name, values in ONLY.items():
        if getattr(fields, name, None) not in (None, *values):
            raise InvalidRequest(f"{name}: not supported by this server, got {show(getattr(fields, name))}")
    if (_count("n", fields.n) or 1) != 1:
        raise InvalidRequest(f"n: only 1 choice per request is supported, got {fields.n}")
    _check("temperature", fields.temperature, lambda t: 0.0 <= t <= 2.0)
    _check("top_p", fields.top_p, lambda p: 0.0 < p <= 1.0)
    for name in ("presence_penalty", "frequency_penalty"):
        _check(name, getattr(fields, name), lambda v: -2.0 <= v <= 2.0)
    _check("top_k", fields.top_k, lambda k: k >= -1)
    _check("min_p", fields.min_p, lambda p: 0.0 <= p <= 1.0)
    _check("repetition_penalty", fields.repetition_penalty, lambda r: 0.0 < r <= 2.0)
    sampling = asked(
        temperature=fields.temperature, top_p=fields.top_p, seed=fields.seed,
        top_k=None if fields.top_k is None else max(0, fields.top_k), min_p=fields.min_p,
        presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
        repetition_penalty=fields.repetition_penalty, logit_bias=_logit_bias(fields.logit_bias),
    )
    stop = fields.stop
    return {
        "model": fields.model, "max_tokens": _count("max_tokens", fields.max_tokens),
        "stream": bool(fields.stream), "sampling": sampling,
        "stop_sequences": api.stop_list([stop] if isinstance(stop, str) else stop or [], "stop"),
    }


def _count(name: str, value: int | None) -> int | None:
    _check(name, value, lambda n: n >= 1)
    return value


def _check(name: str, value: object, holds: Callable[[Any], bool]) -> None:
    """A value, if given, in its range, or the 400 that says the range."""
    if value is not None and not holds(value):
        raise InvalidRequest(f"{name}: expected {EXPECTED[name]}, got {show(value)}")


def _logit_bias(table: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """``{"token id": bias}`` as (id, bias) pairs: ids as decimal strings, biases in -100..100,
    at most :data:`MAX_LOGIT_BIAS` of them (whether each id is in the vocabulary is the model's
    to say: the app checks)."""
    if not table:
        return None
    at_most(len(table), MAX_LOGIT_BIAS, "logit_bias", "entries")
    pairs = []
    for key, bias in table.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9) or not -100.0 <= bias <= 100.0:
            raise InvalidRequest(
                f"logit_bias: expected {EXPECTED['logit_bias']}, got {show(key)}: {show(bias)}"
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _usage(fields: Sampled) -> bool:
    options = fields.stream_options
    if options is None:
        return False
    if not fields.stream:
        raise InvalidRequest("stream_options: only allowed when stream is true")
    if options.include_obfuscation:
        raise InvalidRequest("stream_options.include_obfuscation: not supported by this server, got true")
    return options.include_usage


def _chat_turns(messages: list[ChatMessage]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """System and developer messages joined (one system prompt), then the user/assistant turns,
    as they come (the model's chat template says what consecutive turns of one role mean)."""
    if not messages:
        raise InvalidRequest("messages: expected a non-empty array, got an array")
    at_most(len(messages), MAX_MESSAGES, "messages", "messages per request")
    system, turns = [], []
    for index, message in enumerate(messages):
        try:
            typed.refuse_used(message, MESSAGE_DROPPED)
        except InvalidRequest as refused:
            raise InvalidRequest(f"messages.{index}.{refused}") from None
        content = message.content
        text = content if isinstance(content, str) else _joined(content, f"messages.{index}.content")
        if message.role in ("system", "developer"):
            system.append(text)
        else:
            turns.append((message.role, text))
    text_chars = sum(map(len, system)) + sum(len(text) for _, text in turns)
    at_most(text_chars, MAX_TEXT_CHARS, "messages", "characters of text in system and messages together")
    return "\n\n".join(system), tuple(turns)


def _joined(parts: list[TextPart], where: str) -> str:
    at_most(len(parts), api.MAX_BLOCKS, where, "content parts")
    return "".join(part.text for part in parts)


def _prompt(prompt: str | list[object]) -> str:
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidRequest(f"prompt: expected {EXPECTED['prompt']}")
        prompt = prompt[0]
    at_most(len(prompt), MAX_TEXT_CHARS, "prompt", "characters of text")
    return prompt
