"""No request field is accepted and dropped: every field of the official SDKs' request types is
in docs/http-api.md's table ("Every request field"), and each row is what the codecs do: a field
marked honoured parses, one marked refused (or honoured only in some values) gets a 400 naming
it; a field the APIs do not have is refused by name."""

from __future__ import annotations

import json
import re
import typing

import pytest
from anthropic.types import message_create_params
from openai.types import completion_create_params as legacy_params
from openai.types.chat import completion_create_params as chat_params

from gateway.wire import api, openai
from gateway.wire.anthropic import Messages
from tests.support.doc_commands import ROOT

ROUTES = {"/v1/messages": Messages, "/v1/chat/completions": openai.ChatCompletions,
          "/v1/completions": openai.Completions}
SDK = {
    "/v1/messages": typing.get_type_hints(message_create_params.MessageCreateParamsBase).keys() | {"stream"},
    "/v1/chat/completions": typing.get_type_hints(chat_params.CompletionCreateParamsBase).keys(),
    "/v1/completions": typing.get_type_hints(legacy_params.CompletionCreateParamsBase).keys(),
}
BASES = {
    "/v1/messages": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "hi"},
}
SAMPLING = {"temperature": 0.5, "top_p": 0.9, "seed": 3, "presence_penalty": 1.0, "frequency_penalty": -1.0,
            "logit_bias": {"5": 10}, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "stop": "x",
            "stream": True, "user": "u", "n": 1, "max_tokens": 5,
            "stream_options": {"stream": True, "stream_options": {"include_usage": True}}}
HONOURED = {
    "/v1/messages": {
        "model": "m@1",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        "max_tokens": 7, "system": [{"type": "text", "text": "be brief"}], "stop_sequences": ["x"],
        "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"},
        "cache_control": {"type": "ephemeral", "ttl": "1h"}, "service_tier": "standard_only",
        "speed": "standard",
    },
    "/v1/chat/completions": {
        **SAMPLING, "model": "m@1", "max_completion_tokens": 5, "safety_identifier": "s",
        "prompt_cache_key": "k",
        "messages": [{"role": "developer", "content": "be"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": "ok", "refusal": None}],
        "prompt_cache_retention": "in_memory", "service_tier": "default", "modalities": ["text"],
        "response_format": {"type": "text"},
    },
    "/v1/completions": {**SAMPLING, "model": "m@1", "prompt": ["hi"], "best_of": 1},
}
REFUSED = {
    "/v1/messages": {
        "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
        "max_tokens": 0, "speed": "fast", "tools": [{"name": "t", "input_schema": {}}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "high"}, "container": "c", "mcp_servers": [{"url": "x"}],
        "diagnostics": {"previous_message_id": "msg_1"}, "inference_geo": "eu", "user_profile_id": "p",
        "workspace_id": "w",
    },
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "stream_options": {"stream": True, "stream_options": {"include_obfuscation": True}}, "n": 2,
        "prompt_cache_retention": "24h", "service_tier": "flex", "modalities": ["text", "audio"],
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
        "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
        "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
        "web_search_options": {"search_context_size": "low"}, "moderation": {"model": "m"},
        "verbosity": "low", "reasoning_effort": "low", "store": True, "metadata": {"a": "b"},
        "prompt_cache_options": {"ttl": "1h"},
    },
    "/v1/completions": {"n": 2, "best_of": 2, "echo": True, "suffix": "x", "logprobs": 2},
}


def table(route: str) -> dict[str, str]:
    """Each field of the route's table in docs/http-api.md, with what ferry does."""
    text = (ROOT / "docs" / "http-api.md").read_text().split("## Every request field", 1)[1]
    section = text.split(f"### POST {route}\n", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `"):
            rows.update(dict.fromkeys(re.findall(r"`(\w+)`", cells[0]), cells[1]))
    return rows


def parse(route: str, sample: dict) -> None:
    body = dict(BASES[route])
    body.update(sample)
    ROUTES[route].parse(json.dumps(body).encode())


def sample_of(field: str, value: object) -> dict:
    """A value that uses the field (a few need a companion: stream_options needs a stream)."""
    return value if field == "stream_options" else {field: value}


@pytest.mark.parametrize("route", ROUTES)
def test_every_sdk_field_has_a_row_and_every_row_is_honoured_or_refused(route):
    rows = table(route)
    assert SDK[route] <= rows.keys(), f"fields with no row: {sorted(SDK[route] - rows.keys())}"
    assert all(what.startswith(("honoured", "refused")) for what in rows.values())


@pytest.mark.parametrize(("route", "field"), [(route, field) for route in ROUTES for field in table(route)])
def test_each_row_is_what_the_codec_does(route, field):
    what = table(route)[field]
    if what.startswith("honoured"):
        parse(route, sample_of(field, HONOURED[route][field]))
    if "refused" in what:
        with pytest.raises(api.InvalidRequest) as refused:
            parse(route, sample_of(field, REFUSED[route][field]))
        assert str(refused.value).startswith(field)


@pytest.mark.parametrize("route", ROUTES)
def test_a_field_the_api_does_not_have_is_refused_by_name(route):
    with pytest.raises(api.InvalidRequest, match=r"^frobnicate: not supported by this server, got 1$"):
        parse(route, {"frobnicate": 1})
