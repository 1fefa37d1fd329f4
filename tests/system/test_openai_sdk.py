"""The official ``openai`` SDK, unchanged, against a real ``ferry serve``: chat completions whole
and streamed with max_tokens / max_completion_tokens, stop, temperature and seed; legacy
completions; the models list; its typed errors (429 RateLimitError, overload 503 and a failed
input 500 as InternalServerError); and the Anthropic SDK's count_tokens beside it."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.support.gateway_process import CONFIG, FREE, PAID, Gateway

LIMITED = "sk-test-limited-03"
SDK_CONFIG = CONFIG + f"""
[[keys]]
key = "{LIMITED}"
tenant = "tests"
tier = "paid"
tokens_per_minute = 60
"""
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = Gateway(tmp_path_factory.mktemp("openai"), SDK_CONFIG)
    yield server
    assert server.stop() == 0


def sdk(gateway, key: str = PAID) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def test_a_whole_chat_completion_names_the_version_and_counts_its_tokens(gateway):
    reply = sdk(gateway).chat.completions.create(
        model="echo", messages=[{"role": "system", "content": "be brief"}, *HELLO], max_tokens=100,
        temperature=0.7, seed=42)
    prompt = "System: be brief\n\nUser: hello"
    assert (reply.model, reply.object, reply.choices[0].message.role) == (
        "echo@1",
        "chat.completion",
        "assistant",
    )
    assert reply.choices[0].message.content == prompt and reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(prompt), len(prompt), 2 * len(prompt))
    assert reply.id.startswith("chatcmpl-")


def test_max_tokens_and_max_completion_tokens_cut_the_answer_with_finish_reason_length(gateway):
    client = sdk(gateway)
    for limit in (
        {"max_tokens": 5},
        {"max_completion_tokens": 5},
        {"max_tokens": 50, "max_completion_tokens": 5},
    ):
        reply = client.chat.completions.create(model="echo", messages=HELLO, **limit)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("User:", "length")
        assert reply.usage.completion_tokens == 5


def test_a_stop_string_or_list_ends_the_answer_before_it(gateway):
    client = sdk(gateway)
    for stop in ("llo", ["zz", "llo"]):
        reply = client.chat.completions.create(model="echo", messages=HELLO, stop=stop)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("User: he", "stop")


def test_a_streamed_chat_completion_with_usage_in_the_last_chunk(gateway):
    chunks = list(sdk(gateway).chat.completions.create(
        model="sleepy", messages=HELLO, stream=True, stream_options={"include_usage": True}, max_tokens=8,
        seed=1, temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "User: hello"[::-1][:8]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and (
        chunks[-1].usage.prompt_tokens,
        chunks[-1].usage.completion_tokens,
    ) == (11, 8)
    assert {c.model for c in chunks} == {"sleepy@1"} and len({c.id for c in chunks}) == 1


def test_a_streamed_answer_cut_by_stop_without_usage(gateway):
    chunks = list(
        sdk(gateway).chat.completions.create(model="echo", messages=HELLO, stream=True, stop=["ll"])
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "User: he"
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks)


def test_legacy_completions_take_the_raw_prompt(gateway):
    client = sdk(gateway)
    reply = client.completions.create(model="echo", prompt="abc def", max_tokens=5)
    assert (reply.choices[0].text, reply.choices[0].finish_reason, reply.model) == (
        "abc d",
        "length",
        "echo@1",
    )
    streamed = list(client.completions.create(model="echo", prompt="abc", stream=True))
    assert (
        "".join(c.choices[0].text for c in streamed) == "abc"
        and streamed[-1].choices[0].finish_reason == "stop"
    )


def test_the_models_list_in_openai_shape(gateway):
    assert [model.id for model in sdk(gateway).models.list()] == [
        "sleepy@1",
        "echo@1",
        "held@1",
        "sleepy",
        "echo",
    ]


def test_typed_errors(gateway):
    client = sdk(gateway)
    with pytest.raises(openai.NotFoundError, match="'nope' is not served here") as caught:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n: only 1 choice") as caught:
        client.chat.completions.create(model="echo", messages=HELLO, n=2)
    assert caught.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        sdk(gateway, "sk-unknown-key").chat.completions.create(model="echo", messages=HELLO)
    with pytest.raises(openai.InternalServerError) as caught:  # a failed input: 500
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "POISON"}])
    assert caught.value.status_code == 500


def test_overload_is_a_503_with_retry_after_the_sdk_sees_as_an_internal_server_error(gateway):
    with pytest.raises(
        openai.InternalServerError
    ) as caught:  # free tier, 300 ms budget, a batch that waits 60 s
        sdk(gateway, FREE).chat.completions.create(model="held@1", messages=HELLO)
    error = caught.value
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert int(error.response.headers["Retry-After"]) >= 1 and "retry-after-ms" in error.response.headers
    assert (error.type, error.code) == ("server_error", "overloaded")


def test_a_key_over_its_limit_gets_a_rate_limit_error_with_retry_after(gateway):
    client = sdk(gateway, LIMITED)
    client.chat.completions.create(
        model="echo", messages=HELLO, max_tokens=40
    )  # 11 + 40 of 60 tokens a minute
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="echo", messages=HELLO, max_tokens=40)
    assert caught.value.status_code == 429 and int(caught.value.response.headers["Retry-After"]) >= 1
    assert caught.value.code == "rate_limit_exceeded"


def test_the_anthropic_sdk_counts_tokens_and_sees_its_own_error_shape_on_the_shared_route(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key=PAID, max_retries=0)
    assert client.messages.count_tokens(model="echo", messages=HELLO, system="be brief").input_tokens == len(
        "System: be brief\n\nUser: hello")
    assert [model.id for model in client.models.list()][:2] == ["sleepy@1", "echo@1"]
    status, _, body = gateway.request(
        "GET", "/v1/models", key="sk-unknown-key", headers={"anthropic-version": "2023-06-01"}
    )
    assert (status, body["type"], body["error"]["type"]) == (401, "error", "authentication_error")
    status, _, body = gateway.request("GET", "/v1/models", key="sk-unknown-key")
    assert (status, body["error"]["type"], body["error"]["code"]) == (
        401,
        "invalid_request_error",
        "invalid_api_key",
    )
