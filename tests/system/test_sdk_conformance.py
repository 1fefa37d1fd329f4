"""What both official SDKs read, unchanged, against a real ``ferry serve``: a poison input's 500
that neither retries (``x-should-retry: false``) while an overload they do retry; a request id on
every answer, the client's own when it sends a well-formed one; the rate-limit headers of each
API; ``models.retrieve`` with the context window; a field ferry would drop refused by name; and
a continuous model whose template calls ``strftime_now`` (Llama 3.2's) answering."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.support.gateway_process import CONFIG, PAID, Gateway
from tests.support.real_templates import FOLDER
from tests.support.usage_records import records
from tests.support.waiting import until

LIMITED = "sk-test-limited-03"
HELLO = [{"role": "user", "content": "hello"}]


def config(tmp) -> str:
    llama = tmp / "llama-3.2.jinja"
    llama.write_text(json.loads((FOLDER / "llama-3.2.json").read_text())["chat_template"])
    return CONFIG + f"""
[[keys]]
key = "{LIMITED}"
tenant = "tests"
tier = "paid"
tokens_per_minute = 6000
requests_per_minute = 100

[[models]]
name = "llama-style@1"
mode = "continuous"
simulated = "smollm2-135m"
num_blocks = 256
context_window = 2048
chat_template = "{llama}"
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    server = Gateway(tmp, config(tmp))
    yield server
    assert server.stop() == 0


def clients(gateway, key: str = PAID, retries: int = 2):
    """Both SDKs as their users make them: with their default retries."""
    return (anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=retries),
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=retries))


def failed_records(gateway) -> int:
    return int(gateway.metric("ferry_requests_total", absent=0.0, model="echo@1", tier="paid", status="500"))


def test_neither_sdk_retries_a_poison_input_s_500(gateway):
    claude, gpt = clients(gateway)
    before = failed_records(gateway)
    with pytest.raises(anthropic.InternalServerError) as caught:
        claude.messages.create(model="echo", max_tokens=50, messages=[{"role": "user", "content": "POISON"}])
    assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.InternalServerError) as caught:
        gpt.chat.completions.create(model="echo", messages=[{"role": "user", "content": "POISON"}])
    assert caught.value.response.headers["x-should-retry"] == "false"
    # One request each reached the gateway: the SDKs' two retries (and their workers) never ran
    until(lambda: failed_records(gateway) == before + 2, "the two 500s counted", within=10)
    assert failed_records(gateway) == before + 2


def test_every_answer_names_its_request_and_an_incoming_id_is_echoed(gateway):
    for status, path, key, body in [(401, "/v1/messages", "sk-nobody-0000", {}),
                                    (404, "/v1/nowhere", PAID, None),
                                    (400, "/v1/chat/completions", PAID, {"model": "echo", "messages": []}),
                                    (200, "/healthz", PAID, None)]:
        got, headers, _ = gateway.request("POST" if body is not None else "GET", path, body, key=key)
        assert got == status and headers["request-id"] == headers["x-request-id"]
        assert headers["request-id"].startswith(("msg_", "chatcmpl-", "req_"))
        assert ("x-should-retry" in headers) == (status >= 400) and headers.get("x-should-retry") != "true"
    status, headers, body = gateway.request("POST", "/v1/messages", {"model": "echo", "max_tokens": 20,
                                                                     "messages": HELLO},
                                            headers={"X-Request-Id": "trace-7f3a:42"})
    assert status == 200 and headers["request-id"] == "trace-7f3a:42" and body["id"].startswith("msg_")
    record = records(gateway, {body["id"]})[body["id"]]  # filed under ferry's id, the client's beside it
    assert record.client_request_id == "trace-7f3a:42"
    hostile = "x" * 129
    _, headers, _ = gateway.request("GET", "/healthz", headers={"X-Request-Id": hostile})
    assert headers["request-id"] != hostile and headers["request-id"].startswith("req_")


def test_each_api_shows_its_key_s_limits_in_its_own_headers(gateway):
    claude, gpt = clients(gateway, LIMITED)
    first = claude.messages.with_raw_response.create(model="echo", max_tokens=100, messages=HELLO)
    second = claude.messages.with_raw_response.create(model="echo", max_tokens=100, messages=HELLO)
    headers = second.headers
    assert headers["anthropic-ratelimit-tokens-limit"] == "6000"
    assert headers["anthropic-ratelimit-requests-limit"] == "100"
    assert int(headers["anthropic-ratelimit-requests-remaining"]) < int(
        first.headers["anthropic-ratelimit-requests-remaining"]) <= 99
    assert headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
    chat = gpt.chat.completions.with_raw_response.create(model="echo", messages=HELLO, max_tokens=100)
    assert chat.headers["x-ratelimit-limit-tokens"] == "6000"
    assert int(chat.headers["x-ratelimit-remaining-tokens"]) <= 6000 - 100
    assert chat.headers["x-ratelimit-reset-tokens"].endswith("s")
    unlimited, _ = clients(gateway)
    plain = unlimited.messages.with_raw_response.create(model="echo", max_tokens=10, messages=HELLO)
    assert not any(name.startswith("anthropic-ratelimit") for name in plain.headers)


def test_models_retrieve_names_the_model_and_its_context_window(gateway):
    claude, gpt = clients(gateway)
    info = claude.models.retrieve("echo@1")
    assert (info.id, info.max_input_tokens) == ("echo@1", 255)  # echo@1's window is 256
    assert gpt.models.retrieve("echo").model_extra["max_model_len"] == 256  # an alias: its version's
    listed = {model.id: model.model_extra["max_model_len"] for model in gpt.models.list()}
    assert listed["llama-style@1"] == 2048 and listed["sleepy@1"] == 8192
    with pytest.raises(openai.NotFoundError):
        gpt.models.retrieve("nothing@9")


def test_a_field_ferry_would_drop_is_refused_by_name_in_either_sdk(gateway):
    claude, gpt = clients(gateway, retries=0)
    with pytest.raises(anthropic.BadRequestError, match="output_config: not supported by this server"):
        claude.messages.create(model="echo", max_tokens=10, messages=HELLO, output_config={"effort": "high"})
    with pytest.raises(openai.BadRequestError, match="modalities: not supported by this server"):
        gpt.chat.completions.create(model="echo", messages=HELLO, modalities=["text", "audio"])
    with pytest.raises(openai.BadRequestError, match="frobnicate: not supported by this server"):
        gpt.chat.completions.create(model="echo", messages=HELLO, extra_body={"frobnicate": 1})


def test_a_model_whose_template_calls_strftime_now_answers(gateway):
    claude, gpt = clients(gateway, retries=0)
    reply = claude.messages.create(model="llama-style@1", max_tokens=8, messages=HELLO, system="Be brief.")
    assert reply.stop_reason in ("max_tokens", "end_turn") and reply.content[0].text
    chat = gpt.chat.completions.create(model="llama-style@1", max_tokens=8, messages=HELLO)
    assert chat.usage.prompt_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens - len(
        "Be brief.")


def test_a_chat_request_without_max_tokens_is_charged_its_model_s_default_not_the_window(gateway):
    _, gpt = clients(gateway, LIMITED, retries=0)
    # sleepy@1's window is 8,192, more than this key's 6,000 tokens a minute: charged the whole
    # window, every such request would be a 400; charged the default 4,096, it is answered
    reply = gpt.chat.completions.with_raw_response.create(model="sleepy", messages=HELLO)
    assert reply.status_code == 200
    assert int(reply.headers["x-ratelimit-remaining-tokens"]) < 6000 - 4096
