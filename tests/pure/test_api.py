"""The pure codecs of the HTTP API: validation, prompts, answers, SSE events and the error table,
plus the small pure helpers around them (tokenizer, keys, model names). No server, no loop."""

from __future__ import annotations

import hashlib
import json

import pytest

from batcher.core.backend import Delta, Finished, Started, Usage
from batcher.core.errors import Overloaded, RequestFailed
from batcher.fixed.config import FixedModelConfig
from gateway.accounting.auth import KeyRing
from gateway.config import KeyConfig
from gateway.ops.models import Catalog
from gateway.text.answer import Answer
from gateway.text.chat import Labelled
from gateway.text.tokenizer import ByteTokenizer, make_tokenizer
from gateway.wire import anthropic, api
from gateway.wire.anthropic import Messages

BYTES = ByteTokenizer()


def body(**fields) -> bytes:
    base = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_a_minimal_request_parses_with_defaults():
    request = anthropic.parse_message_request(body())
    assert request == anthropic.MessageRequest(model="m", messages=(("user", "hi"),), max_tokens=10)


def test_fields_that_say_they_are_not_used_pass():
    request = anthropic.parse_message_request(
        body(tools=[], tool_choice={"type": "none"}, thinking={"type": "disabled"})
    )
    assert request == anthropic.MessageRequest(model="m", messages=(("user", "hi"),), max_tokens=10)


def test_text_blocks_are_joined_and_ignored_fields_pass():
    request = anthropic.parse_message_request(body(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "c"}],
        temperature=0, stream=True, stop_sequences=["x"], metadata={"user_id": "u"}, top_k=5,
    ))
    assert request.system == "be brief"
    assert request.messages == (("user", "ab"), ("assistant", "c"))
    assert (request.temperature, request.stream, request.stop_sequences) == (0.0, True, ("x",))


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (b"{", "body: expected a JSON object, got invalid JSON"),
        (b"\xff\xfe", "body: expected a JSON object, got invalid JSON"),
        (b"[1]", "body: expected a JSON object, got an array"),
        (b"[" * 100_000 + b"]" * 100_000, "body: expected a JSON object"),
        (body(model=...), "model: field required"),
        (body(model=7), "model: expected a string, got 7"),
        (body(model=""), "model: expected a model name"),
        (body(messages=...), "messages: field required"),
        (body(messages=[]), "messages: expected a non-empty array"),
        (body(messages=["hi"]), "messages.0: expected an object"),
        (body(messages=[{"content": "x"}]), "messages.0.role: field required"),
        (body(messages=[{"role": "system", "content": "x"}]), "messages.0.role: expected one of"),
        (body(messages=[{"role": "user"}]), "messages.0.content: field required"),
        (
            body(messages=[{"role": "user", "content": None}]),
            "messages.0.content: expected a string or an array",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image"}]}]),
            "messages.0.content.0.type: \"image\" blocks are not supported by this server; its models read "
            "'text' blocks only",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages.0.content.0.text: field required",
        ),
        (
            body(messages=[{"role": "user", "content": "\ud800"}]),
            "body: expected valid Unicode text, got a lone surrogate escape",
        ),
        (body(max_tokens=...), "max_tokens: field required"),
        (body(max_tokens=0), "max_tokens: expected an integer >= 1, got 0"),
        (body(max_tokens=1.5), "max_tokens: expected an integer >= 1, got 1.5"),
        (body(max_tokens=True), "max_tokens: expected an integer >= 1, got true"),
        (body(max_tokens="9"), 'max_tokens: expected an integer >= 1, got "9"'),
        (body(temperature=2), "temperature: expected a number in 0..1, got 2"),
        (body(temperature="hot"), "temperature: expected a number in 0..1"),
        (body(stream="yes"), "stream: expected a boolean"),
        (body(system=5), "system: expected a string or an array"),
        (body(stop_sequences="x"), "stop_sequences: expected an array of strings"),
        (body(stop_sequences=[""]), "stop_sequences: expected non-empty strings"),
        (body(stop_sequences=[1]), "stop_sequences.0: expected a string"),
        (body(metadata=[]), "metadata: expected an object"),
        (
            body(tools=[{"name": "t", "input_schema": {}}]),
            "tools: not supported by this server, got an array",
        ),
        (body(tool_choice={"type": "any"}), "tool_choice: not supported by this server, got an object"),
        (body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking: not supported by this server"),
        (body(mcp_servers=[{"url": "x"}]), "mcp_servers: not supported by this server"),
    ],
)
def test_every_bad_field_is_named(raw, names):
    with pytest.raises(api.InvalidRequest) as caught:
        anthropic.parse_message_request(raw)
    assert str(caught.value).startswith(names)
    assert api.error_kind(caught.value) == api.ErrorKind(400, "invalid_request_error")


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (body(stop_sequences=["s"] * 17), "stop_sequences: at most 16 stop sequences per request, got 17"),
        (
            body(stop_sequences=["x" * 257]),
            "stop_sequences.0: at most 256 characters in a stop sequence, got 257",
        ),
        (
            body(messages=[{"role": "user", "content": "x"}] * 100_001),
            "messages: at most 100,000 messages per request, got 100,001",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 1001}]),
            "messages.0.content: at most 1,000 content blocks, got 1,001",
        ),
        (
            body(system=[{"type": "text", "text": "x"}] * 1001),
            "system: at most 1,000 content blocks, got 1,001",
        ),
        (
            body(system="s" * (1 << 20), messages=[{"role": "user", "content": "u" * ((1 << 20) + 1)}]),
            "messages: at most 2,097,152 characters of text in system and messages together, got 2,097,153",
        ),
    ],
)
def test_every_limit_is_refused_with_a_400_that_names_it(raw, names):
    with pytest.raises(api.InvalidRequest) as caught:
        anthropic.parse_message_request(raw)
    assert str(caught.value) == names


def test_requests_at_every_limit_pass():
    request = anthropic.parse_message_request(
        body(
            stop_sequences=["s" * 256] * 16,
            messages=[{"role": "user", "content": [{"type": "text", "text": "t"}] * 1000}],
        )
    )
    assert len(request.stop_sequences) == 16 and request.messages == (("user", "t" * 1000),)


def test_the_issues_hostile_body_is_refused_on_the_count_of_its_stop_sequences():
    hostile = body(messages=[{"role": "user", "content": "a" * 4000}],
                   stop_sequences=[f"q{i:06d}" for i in range(400_000)])  # ~4 MB
    with pytest.raises(api.InvalidRequest, match="at most 16 stop sequences per request, got 400,000"):
        anthropic.parse_message_request(hostile)


def test_the_prompt_is_system_then_labelled_turns():
    request = anthropic.parse_message_request(
        body(
            system="be brief",
            messages=[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
        )
    )
    assert (
        Labelled().render(request.system, request.messages)
        == "System: be brief\n\nUser: hello\n\nAssistant: hi"
    )
    request = anthropic.parse_message_request(body())
    assert Labelled().render(request.system, request.messages) == "User: hi"


def test_context_window_counts_prompt_plus_max_tokens():
    assert api.context_overflow(90, 10, 100) is None
    error = api.context_overflow(91, 10, 100)
    assert isinstance(error, api.InvalidRequest)
    assert "91 prompt tokens + max_tokens 10 = 101 > 100" in str(error)


@pytest.mark.parametrize(
    ("output", "stops", "max_tokens", "expected"),
    [
        ("hello world", (), 100, api.Completion("hello world", "end_turn", None, 11)),
        ("hello world", ("o w", "ll"), 100, api.Completion("he", "stop_sequence", "ll", 2)),
        ("hello world", ("zz",), 5, api.Completion("hello", "max_tokens", None, 5)),
        ("héé", (), 2, api.Completion("h", "max_tokens", None, 1)),  # é is 2 bytes: never split
        ("ab", (), 2, api.Completion("ab", "end_turn", None, 2)),
    ],
)
def test_an_answer_stops_at_the_earliest_stop_sequence_then_at_max_tokens(
    output, stops, max_tokens, expected
):
    answer = Answer(stops, max_tokens, BYTES)
    answer.push([Started(0.0), Delta(output, BYTES.count(output)), Finished("end_turn", Usage(1, 0, 1))])
    assert answer.completion() == expected


def test_a_whole_message_has_the_messages_api_shape():
    completion = api.Completion("olleh", "end_turn", None, 5, cached_tokens=4)
    assert anthropic.message_body("msg_1", "m@1", completion, 7) == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m@1",
        "content": [{"type": "text", "text": "olleh"}], "stop_reason": "end_turn", "stop_sequence": None,
        # the prompt is 7 tokens: 4 from the prefix cache, 3 not
        "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                  "output_tokens": 5},
    }


def parse_sse(data: bytes) -> list[tuple[str, dict]]:
    """A strict reader fed one byte at a time: every event is `event:` + one `data:` line."""
    events, buffer = [], b""
    for byte in data:
        buffer += bytes([byte])
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            name, payload = block.decode().split("\n")
            assert name.startswith("event: ") and payload.startswith("data: ")
            events.append((name[7:], json.loads(payload[6:])))
    assert buffer == b""
    return events


def test_a_stream_sends_the_events_in_the_messages_api_order():
    raw = (anthropic.stream_start("msg_1", "m@1", 7) + anthropic.PING + anthropic.BLOCK_START
           + anthropic.text_delta("olleh")
           + anthropic.stream_stop("max_tokens", None, anthropic.usage(7, 4, 5)))
    events = parse_sse(raw)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]) == (
        [],
        None,
        {"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
         "output_tokens": 0},
    )
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "olleh"}
    assert events[5][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                  "output_tokens": 5},  # the cache's share is known at the end: the SDK takes it from here
    }


def test_an_empty_answer_streams_no_delta_and_an_error_event_has_the_error_body():
    empty = anthropic.BLOCK_START + anthropic.stream_stop("end_turn", None, anthropic.usage(1, 0, 0))
    names = [name for name, _ in parse_sse(empty)]
    assert names == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]
    [(name, data)] = parse_sse(anthropic.stream_error(Overloaded("busy")))
    assert (name, data) == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
    )


@pytest.mark.parametrize(
    ("error", "status", "kind", "headers"),
    [
        (api.InvalidRequest("x"), 400, "invalid_request_error", {}),
        (api.AuthenticationFailed("x"), 401, "authentication_error", {}),
        (api.NotFound("x"), 404, "not_found_error", {}),
        (api.RequestTooLarge("x"), 413, "request_too_large", {}),
        (Overloaded("x"), 529, "overloaded_error", {"Retry-After": "1", "retry-after-ms": "1000"}),
        (
            Overloaded("x", retry_after=0.31),
            529,
            "overloaded_error",
            {"Retry-After": "1", "retry-after-ms": "310"},
        ),
        (api.RateLimited("x", 2.5), 429, "rate_limit_error", {"Retry-After": "3", "retry-after-ms": "2500"}),
        (RequestFailed("x"), 500, "api_error", {}),
    ],
)
def test_the_error_table(error, status, kind, headers):
    assert api.error_response(error) == (
        status,
        api.dumps(api.error_body(api.ErrorKind(status, kind), "x")),
        headers,
    )


def test_an_unexpected_error_is_a_500_that_reveals_nothing():
    status, raw, headers = api.error_response(KeyError("secret internals"))
    assert (status, json.loads(raw), headers) == (
        500, {"type": "error", "error": {"type": "api_error", "message": "internal error"}}, {})


def test_bare_statuses_map_through_the_same_table():
    assert api.kind_for_status(404).type == "not_found_error"
    assert api.kind_for_status(405) == api.ErrorKind(405, "invalid_request_error")
    assert api.kind_for_status(503).type == "overloaded_error"  # as the server says it when shutting down
    assert api.kind_for_status(502) == api.ErrorKind(502, "api_error")


def test_models_list_names_the_versions():
    assert anthropic.models_body([("a@1", 8192), ("b@2", 8192)], "2026-01-01T00:00:00Z") == {
        "data": [
            {"type": "model", "id": n, "display_name": n, "created_at": "2026-01-01T00:00:00Z",
             "max_input_tokens": 8191, "max_tokens": 8191}
            for n in ("a@1", "b@2")
        ],
        "has_more": False,
        "first_id": "a@1",
        "last_id": "b@2",
    }


def test_the_byte_tokenizer_counts_utf8_bytes():
    tokenizer = make_tokenizer("bytes")
    assert tokenizer.count("héllo") == 6
    assert tokenizer.truncate("héllo", 2) == "h" and tokenizer.truncate("héllo", 3) == "hé"
    with pytest.raises(ValueError, match=r"tokenizer: expected 'bytes' or a tokenizer.json"):
        make_tokenizer("bpe")


def test_keys_by_value_or_by_digest_and_in_either_header():
    ring = KeyRing([
        KeyConfig(tenant="a", tier="paid", key="sk-paid-000001"),
        KeyConfig(tenant="b", tier="free", key_sha256=hashlib.sha256(b"sk-free-000002").hexdigest()),
    ])
    assert ring.authenticate({"x-api-key": "sk-paid-000001"}).tier == "paid"
    assert ring.authenticate({"authorization": "Bearer sk-free-000002"}).tenant == "b"
    for headers, message in [({}, "no API key"), ({"x-api-key": "sk-nope"}, "invalid x-api-key"),
                             ({"authorization": "Basic sk-paid-000001"}, "no API key")]:
        with pytest.raises(api.AuthenticationFailed, match=message):
            ring.authenticate(headers)


def test_aliases_resolve_to_one_version():
    catalog = Catalog.of([FixedModelConfig(name="m@2", worker=("echo",), aliases=("m", "latest"))])
    assert catalog.resolve("m").name == catalog.resolve("latest").name == "m@2"
    with pytest.raises(api.NotFound, match="'m@1' is not served here; try one of: latest, m, m@2"):
        catalog.resolve("m@1")


def test_consecutive_messages_of_one_role_are_one_turn_and_a_last_assistant_turn_is_a_prefill():
    request = anthropic.parse_message_request(body(messages=[
        {"role": "user", "content": "Name a colour. "},
        {"role": "user", "content": [{"type": "text", "text": "Go."}]},
        {"role": "assistant", "content": "My colour"},
        {"role": "assistant", "content": " is"},
    ]))
    assert request.messages == (("user", "Name a colour. Go."), ("assistant", "My colour is"))
    assert request.prefill and Messages(request).call.prefill
    assert not anthropic.parse_message_request(body()).prefill


def test_a_prefill_may_not_end_with_whitespace_as_the_api_says():
    with pytest.raises(api.InvalidRequest, match=r"^messages.1.content: the final assistant content"):
        anthropic.parse_message_request(body(messages=[{"role": "user", "content": "a"},
                                                       {"role": "assistant", "content": "b "}]))


def test_labelled_prompts_leave_a_prefill_open():
    assert Labelled().render("", [("user", "Hi"), ("assistant", "Hello, I")], prefill=True) == (
        "User: Hi\n\nAssistant: Hello, I")


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"messages": [{"role": "user", "content": "x", "name": "b"}]}, "messages.0.name: not supported"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
            "messages.0.content.0.citations: not supported",
        ),
        ({"metadata": {"user_id": "u", "plan": "gold"}}, 'metadata.plan: not supported by this server'),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config: not supported by this"),
        ({"speed": "fast"}, 'speed: not supported by this server, got "fast"'),
        ({"inference_geo": "eu"}, 'inference_geo: not supported by this server, got "eu"'),
    ],
)
def test_what_ferry_would_drop_is_refused_by_name(fields, names):
    with pytest.raises(api.InvalidRequest) as caught:
        anthropic.parse_message_request(body(**fields))
    assert str(caught.value).startswith(names)


def test_fields_that_mean_nothing_here_pass():
    request = anthropic.parse_message_request(body(
        output_config={"effort": None}, cache_control={"type": "ephemeral"}, service_tier="auto",
        speed="standard",
        messages=[{"role": "user",
                   "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}],
    ))
    assert request.messages == (("user", "x"),)


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (Overloaded("busy"), True), (api.RateLimited("slow down", 1.0), True),
        (api.RequestTimeout("late"), True), (api.ShuttingDown("bye"), True), (api.Unavailable("down"), True),
        (RequestFailed("poison"), False),
        (api.InvalidRequest("bad"), False), (api.NotFound("who"), False), (KeyError("bug"), False),
    ],
)
def test_whether_a_retry_may_succeed_follows_the_error(error, retry):
    assert api.should_retry(error) is retry
