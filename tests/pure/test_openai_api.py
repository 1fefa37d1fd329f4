"""The OpenAI-compatible codecs, pure: what each body parses into, every refusal naming its
field, whole bodies, the chunk stream read one byte at a time (by a strict reader and by the
SDK's own decoder), finish reasons, and the error table with overload as 503."""

from __future__ import annotations

import json

import pytest
from openai._streaming import SSEDecoder

from batcher.core.backend import Sampling
from batcher.core.errors import Overloaded, RequestFailed
from gateway.wire import anthropic, api, openai
from gateway.wire.anthropic import Messages
from gateway.wire.codec import Call, Head

HEAD = Head("chatcmpl-7", "m@2", 5, 1700000000)


def chat(**fields) -> bytes:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_a_chat_body_parses_into_the_shared_call():
    parsed = openai.ChatCompletions.parse(
        chat(
            messages=[
                {"role": "system", "content": "be"},
                {"role": "developer", "content": [{"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "?"},
            ],
            max_tokens=9,
            temperature=1.5,
            top_p=0.5,
            seed=7,
            stop="##",
            user="u-1",
            frequency_penalty=0.2,
        )
    )
    assert parsed.call == Call("m", 9, "be\n\nbrief", (("user", "hi"), ("assistant", "yo"), ("user", "?")),
                               sampling=Sampling(temperature=1.5, top_p=0.5, seed=7, frequency_penalty=0.2),
                               stop_sequences=("##",),
                               session="u-1")
    assert not parsed.include_usage


def test_max_completion_tokens_wins_and_defaults_follow_openai():
    assert openai.ChatCompletions.parse(chat(max_tokens=5, max_completion_tokens=3)).call.max_tokens == 3
    assert openai.ChatCompletions.parse(chat()).call.max_tokens is None  # the model's default_max_tokens
    completion = openai.Completions.parse(
        json.dumps({"model": "m", "prompt": ["once"], "stop": ["a", "b"]}).encode()
    )
    assert (completion.call.prompt, completion.call.max_tokens, completion.call.stop_sequences) == (
        "once",
        16,
        ("a", "b"),
    )
    streamed = openai.ChatCompletions.parse(chat(stream=True, stream_options={"include_usage": True}))
    assert streamed.call.stream and streamed.include_usage


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (b"{", "body: expected a JSON object, got invalid JSON"),
        (b"[]", "body: expected a JSON object, got an array"),
        (chat(model=...), "model: field required"),
        (chat(messages=[]), "messages: expected a non-empty array"),
        (
            chat(messages=[{"role": "tool", "content": "x"}]),
            "messages.0.role: expected one of system, developer",
        ),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0.type"),
        (chat(messages=[{"role": "assistant"}]), "messages.0.content: field required"),
        (chat(n=2), "n: only 1 choice per request is supported, got 2"),
        (chat(n=0), "n: expected an integer >= 1, got 0"),
        (chat(max_tokens=0), "max_tokens: expected an integer >= 1, got 0"),
        (chat(max_completion_tokens="5"), "max_completion_tokens: expected an integer >= 1"),
        (chat(temperature=2.5), "temperature: expected a number in 0..2, got 2.5"),
        (chat(top_p=0), "top_p: expected a number in (0, 1]"),
        (chat(seed=1.5), "seed: expected an integer, got 1.5"),
        (chat(stop=[""]), "stop: expected non-empty strings"),
        (chat(stop=5), "stop: expected a string or an array of strings, got 5"),
        (chat(stop=["s"] * 17), "stop: at most 16 stop sequences per request, got 17"),
        (chat(stop="x" * 257), "stop.0: at most 256 characters in a stop sequence, got 257"),
        (chat(stream="yes"), "stream: expected a boolean"),
        (chat(stream_options={"include_usage": True}), "stream_options: only allowed when stream is true"),
        (
            chat(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage: expected a boolean, got 1",
        ),
        (chat(tools=[{"type": "function"}]), "tools: not supported by this server"),
        (chat(logprobs=True), "logprobs: not supported by this server, got true"),
        (chat(response_format={"type": "json_object"}), "response_format: not supported"),
        (chat(user=7), "user: expected a string, got 7"),
        (json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), "prompt: expected one string"),
        (json.dumps({"model": "m", "prompt": [1, 2]}).encode(), "prompt: expected one string"),
        (json.dumps({"model": "m", "prompt": "a", "echo": True}).encode(), "echo: not supported"),
        (json.dumps({"model": "m", "prompt": "a", "best_of": 3}).encode(), "best_of: only 1 choice"),
    ],
)
def test_every_refusal_names_its_field(raw, names):
    route = openai.Completions if b'"prompt"' in raw else openai.ChatCompletions
    with pytest.raises(api.InvalidRequest) as caught:
        route.parse(raw)
    assert str(caught.value).startswith(names)


def test_a_whole_chat_answer_and_a_whole_completion_have_openai_shapes():
    completion = api.Completion("olleh", "max_tokens", None, 5)
    body = json.loads(openai.ChatCompletions.parse(chat()).whole(HEAD, completion, blocked=False))
    assert body == {
        "id": "chatcmpl-7", "object": "chat.completion", "created": 1700000000, "model": "m@2",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "olleh", "refusal": None},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    legacy = openai.Completions.parse(json.dumps({"model": "m", "prompt": "x"}).encode())
    body = json.loads(legacy.whole(HEAD, api.Completion("ok", "stop_sequence", "##", 2), blocked=False))
    assert (body["object"], body["choices"]) == ("text_completion", [
        {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}])


@pytest.mark.parametrize(("stop_reason", "blocked", "finish"), [
    ("end_turn", False, "stop"), ("stop_sequence", False, "stop"), ("max_tokens", False, "length"),
    ("end_turn", True, "content_filter"), ("refusal", True, "content_filter"),
])
def test_finish_reasons(stop_reason, blocked, finish):
    assert openai.finish_reason(stop_reason, blocked) == finish


def read_chunks(raw: bytes) -> list[dict | str]:
    """A strict reader fed one byte at a time: each event is one `data:` line (JSON or [DONE])
    or a `:` comment; the SDK's own decoder, fed the same way, must read the same data."""
    events, buffer = [], b""
    for byte in raw:
        buffer += bytes([byte])
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            line = block.decode()
            assert "\n" not in line and (line.startswith("data: ") or line.startswith(": "))
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    assert buffer == b""
    sdk = [event.data for event in SSEDecoder().iter_bytes(bytes([b]) for b in raw)]
    assert sdk == [
        e if isinstance(e, str) else json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events
    ]
    return events


def test_a_chat_stream_read_one_byte_at_a_time():
    stream = openai.ChatCompletions.parse(chat(stream=True, stream_options={"include_usage": True})).stream(
        HEAD
    )
    raw = (
        stream.start()
        + stream.ping
        + stream.text("Hél")
        + stream.text("")
        + stream.text("lo")
        + stream.stop("end_turn", None, 6, blocked=False)
    )
    events = read_chunks(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(c["id"], c["object"], c["model"], c["created"]) for c in chunks} == {
        ("chatcmpl-7", "chat.completion.chunk", "m@2", 1700000000)}
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hél"}, {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_completion_stream_has_no_opening_and_no_usage_unless_asked():
    stream = openai.Completions.parse(
        json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    ).stream(HEAD)
    assert stream.start() == b""
    events = read_chunks(stream.text("ab") + stream.stop("max_tokens", None, 2, blocked=False))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ("ab", None), ("", "length")]
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


def test_a_failure_after_the_headers_is_an_error_chunk_then_done():
    stream = openai.ChatCompletions.parse(chat(stream=True)).stream(HEAD)
    events = read_chunks(stream.start() + stream.error(RequestFailed("the worker was lost")))
    assert events[1:] == [{"error": {"message": "the worker was lost", "type": "server_error", "param": None,
                                     "code": None}}, "[DONE]"]


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "param", "headers"),
    [
        (
            api.InvalidRequest("messages.0.content: field required"),
            400,
            "invalid_request_error",
            None,
            "messages.0.content",
            {},
        ),
        (
            api.AuthenticationFailed("invalid x-api-key"),
            401,
            "invalid_request_error",
            "invalid_api_key",
            None,
            {},
        ),
        (
            api.NotFound("model: 'x' is not served here"),
            404,
            "invalid_request_error",
            "model_not_found",
            "model",
            {},
        ),
        (
            api.RequestTooLarge("body: over the limit"),
            413,
            "invalid_request_error",
            "request_too_large",
            "body",
            {},
        ),
        (
            api.RateLimited("slow down", 2.5),
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            None,
            {"Retry-After": "3", "retry-after-ms": "2500"},
        ),
        (
            Overloaded("busy", retry_after=0.31),
            503,
            "server_error",
            "overloaded",
            None,
            {"Retry-After": "1", "retry-after-ms": "310"},
        ),
        (RequestFailed("failed"), 500, "server_error", None, None, {}),
        (KeyError("secret internals"), 500, "server_error", None, None, {}),
    ],
)
def test_the_error_table_in_openai_shape(error, status, kind, code, param, headers):
    got_status, raw, got_headers = openai.error_response(error)
    message = "internal error" if isinstance(error, KeyError) else str(error)
    assert (got_status, got_headers) == (status, headers)
    assert json.loads(raw) == {"error": {"message": message, "type": kind, "param": param, "code": code}}


def test_an_unknown_route_is_not_an_unknown_model():
    status, raw = openai.error_reply(api.kind_for_status(404), "GET /v1/nothing: not found")
    assert (status, json.loads(raw)["error"]["code"]) == (404, None)


def test_the_anthropic_codec_keeps_its_stream_and_passes_the_session():
    parsed = Messages.parse(
        json.dumps(
            {
                "model": "m",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "x"}],
                "metadata": {"user_id": "u-9"},
            }
        ).encode()
    )
    assert (parsed.call.session, parsed.call.max_tokens, parsed.call.turns) == ("u-9", 3, (("user", "x"),))
    stream = parsed.stream(Head("msg_1", "m@1", 1, 0))
    block = anthropic.BLOCK_START
    assert stream.stop("end_turn", None, 0, blocked=False).startswith(block)  # an empty answer's block
    stream = parsed.stream(Head("msg_1", "m@1", 1, 0))
    assert stream.text("a").startswith(block) and not stream.text("b").startswith(block)
    with pytest.raises(api.InvalidRequest, match=r"metadata.user_id: expected a string"):
        Messages.parse(
            json.dumps(
                {
                    "model": "m",
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": "x"}],
                    "metadata": {"user_id": 5},
                }
            ).encode()
        )


def test_models_list_in_openai_shape():
    assert openai.models_body([("a@1", 4096), ("a", 2048)], 1700000000) == {"object": "list", "data": [
        {"id": "a@1", "object": "model", "created": 1700000000, "owned_by": "ferry", "max_model_len": 4096},
        {"id": "a", "object": "model", "created": 1700000000, "owned_by": "ferry", "max_model_len": 2048}]}


def test_penalties_logit_bias_and_vllm_s_sampling_fields_reach_the_sampling():
    call = openai.ChatCompletions.parse(chat(
        presence_penalty=0.5, frequency_penalty=-1, logit_bias={"42": -100, "7": 3.5}, top_k=-1,
        min_p=0.05, repetition_penalty=1.1, max_tokens=9)).call
    assert call.sampling == Sampling(presence_penalty=0.5, frequency_penalty=-1.0, top_k=0, min_p=0.05,
                                     logit_bias=((7, 3.5), (42, -100.0)), repetition_penalty=1.1)
    legacy = openai.Completions.parse(json.dumps({"model": "m", "prompt": "x", "top_k": 40}).encode()).call
    assert legacy.sampling.top_k == 40


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        (
            {"logit_bias": {"x": 1}},
            'logit_bias: expected an object of at most 300 token ids to biases in -100..100, got "x": 1',
        ),
        ({"logit_bias": {"5": 101}}, "logit_bias: expected an object"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: at most 300 entries, got 301"),
        ({"presence_penalty": 3}, "presence_penalty: expected a number in -2..2, got 3"),
        ({"repetition_penalty": 0}, "repetition_penalty: expected a number in (0, 2], got 0"),
        ({"min_p": 2}, "min_p: expected a number in 0..1, got 2"),
        ({"top_k": -2}, "top_k: expected an integer >= -1"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages.0.tool_calls: not supported",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role: expected one of system"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfusc"),
    ],
)
def test_the_new_fields_name_what_is_wrong(fields, names):
    with pytest.raises(api.InvalidRequest) as caught:
        openai.ChatCompletions.parse(chat(**fields))
    assert str(caught.value).startswith(names)


def test_a_logit_bias_outside_the_vocabulary_is_named():
    assert api.outside_vocabulary(((3, 1.0), (255, 2.0)), 256) is None
    error = api.outside_vocabulary(((3, 1.0), (256, 2.0)), 256)
    assert str(error) == "logit_bias: token id 256 is not in this model's vocabulary of 256 tokens"


def test_a_chat_request_without_max_tokens_leaves_it_to_the_model():
    assert openai.ChatCompletions.parse(chat()).call.max_tokens is None
    assert openai.ChatCompletions.parse(chat(safety_identifier="s")).call.session == "s"
