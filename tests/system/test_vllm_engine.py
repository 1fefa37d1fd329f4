"""ferry scheduling a real vLLM engine (``engine = "vllm"``) over real HTTP, on SmolLM2-135M on this
CPU: the answer vLLM's own OpenAI server gives, streaming, abort on disconnect, ``/metrics``, and an
engine SIGKILLed under its streams. One ``ferry serve`` with one vLLM engine (eager mode: ~15 s to
start, not a minute of torch.compile) serves the whole module; the kill comes last.

vLLM lives in its own virtualenv (``make vllm-env``; ``make test`` and CI build it). Where it has
not been built these tests are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import aiohttp
import pytest
from tokenizers import Tokenizer

from gateway.accounting.usage import read_usage
from tests.support.engine_reports import reported_after
from tests.support.gateway_process import PAID, Gateway
from tests.support.sse_client import message_id, stream
from tests.support.usage_records import records
from tests.support.vllm_server import VLLM_PYTHON, VllmOpenAIServer, vllm_installed
from tests.support.waiting import until, until_asyncio
from workers.vllm_preload import preloads

pytestmark = pytest.mark.skipif(
    not vllm_installed(), reason="vLLM's virtualenv .venv-vllm is not built here (`make vllm-env` builds it)"
)

MODEL = "vllm@1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to read, in ten parts."}]


def config(model_dir: str, tmp) -> str:
    return f"""
[server]
port = 0
ping_interval_ms = 500

[[tiers]]
name = "paid"
wait_budget_ms = 120000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"

[[models]]
name = "{MODEL}"
mode = "continuous"
engine = "vllm"
python = "{VLLM_PYTHON}"
model = "{model_dir}"
dtype = "bfloat16"
workers = 1
kv_memory_gb = 0.25
max_batch_tokens = 2048
context_window = 2048
stats_timeout_ms = 60000
temperature = 0.0

[state]
dir = "{tmp}"
"""


@pytest.fixture(scope="module")
def gateway(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    server = Gateway(tmp, config(str(smollm2), tmp))
    yield server
    assert server.stop() == 0


def post(url: str, path: str, body: dict, key: str | None = PAID) -> dict:
    """One whole answer; a busy 2-core machine may take a minute over it, so no short timeout."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, method="POST", data=json.dumps(body).encode(),
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def chat(url: str, model: str, messages: list, max_tokens: int, key: str | None = PAID, **fields) -> dict:
    """A whole greedy chat completion on the OpenAI route (``fields``: more sampling)."""
    return post(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                               "temperature": 0, **fields}, key)


async def watched_stream(session, url: str, request: dict, seen: dict) -> dict:
    """A stream on the Messages route whose deltas so far the caller can watch in ``seen``."""
    seen.update(text="", deltas=0, last=None)
    async with session.post(url + "/v1/messages", json={**request, "stream": True},
                            headers={"x-api-key": PAID}) as response:
        async for line in response.content:
            if line.startswith(b"data: "):
                data = json.loads(line[6:])
                seen["last"] = data
                if data["type"] == "content_block_delta":
                    seen["text"] += data["delta"]["text"]
                    seen["deltas"] += 1
    return seen


def engine(gateway: Gateway) -> dict:
    return gateway.ready()["models"][MODEL]["workers"][0]


def settled(gateway: Gateway) -> float:
    """Tokens vLLM has generated, once a report taken from now on shows its engine idle.

    The last report may be older than the last request, so an idle one from before it proves
    nothing: only a report taken after the request ended, running nothing and owed nothing, has
    counted every token vLLM will make for it."""
    reported_after(gateway, MODEL, time.monotonic(), idle=True, within=60)
    return gateway.metric("ferry_engine_generated_tokens_total", model=MODEL)


def test_a_greedy_answer_is_the_one_vllms_own_openai_server_gives(gateway, smollm2, tmp_path):
    # The same answer with penalties, a logit bias and vLLM's own fields: ferry passes each to
    # vLLM's SamplingParams as vLLM's server does (the bias bans the plain answer's first token)
    banned = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode("The").ids[0]
    adjusted = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05,
                "top_k": 20, "logit_bias": {str(banned): -100}}
    ours = chat(gateway.url, MODEL, QUESTION, 40)
    ours_adjusted = chat(gateway.url, MODEL, QUESTION, 40, **adjusted)
    peer = VllmOpenAIServer(str(smollm2), tmp_path / "vllm.log", kv_memory_gb=1)
    peer.start()
    try:
        theirs = chat(peer.url, str(smollm2), QUESTION, 40, key=None)
        theirs_adjusted = chat(peer.url, str(smollm2), QUESTION, 40, key=None, **adjusted)
    finally:
        peer.stop()
    text = ours_adjusted["choices"][0]["message"]["content"]
    assert text == theirs_adjusted["choices"][0]["message"]["content"]
    assert text != ours["choices"][0]["message"]["content"] and not text.startswith("The")
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the same chat template rendering too
    assert {k: ours["usage"][k] for k in counts} == {k: theirs["usage"][k] for k in counts}
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]


def test_a_stream_arrives_token_by_token_and_says_what_the_whole_answer_says(gateway):
    request = {"model": MODEL, "max_tokens": 24, "messages": STORY}
    whole = post(gateway.url, "/v1/messages", request)

    async def run():
        async with aiohttp.ClientSession() as session:
            return await stream(session, gateway.url, request)

    streamed = asyncio.run(run())
    assert streamed["status"] == 200 and streamed["events"][-1][0] == "message_stop"
    assert streamed["text"] == whole["content"][0]["text"]
    assert len(streamed["times"]) > 10  # many deltas, not one piece at the end
    delta = next(data for name, data in streamed["events"] if name == "message_delta")
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 24


def test_a_client_that_leaves_mid_stream_has_its_sequence_aborted_in_vllm(gateway):
    async def leave():
        async with aiohttp.ClientSession() as session:
            return await stream(session, gateway.url, {"model": MODEL, "max_tokens": 1000, "messages": STORY},
                                leave_after=3)

    before = settled(gateway)
    left = asyncio.run(leave())
    assert left["status"] == 200 and len(left["times"]) == 3
    generated = settled(gateway) - before  # the 1,000 asked for would take vLLM most of a minute here
    usage = records(gateway, {message_id(left)})[message_id(left)]
    assert (usage.status, usage.outcome) == (499, "cancelled") and usage.output_tokens >= 3
    assert usage.output_tokens <= generated < 100, (usage.output_tokens, generated)


def test_metrics_show_vllms_kv_cache_prefix_cache_and_steps_under_ferrys_families(gateway):
    for _ in range(2):  # the same prompt twice: the second finds its prefix in vLLM's cache
        post(gateway.url, "/v1/messages", {"model": MODEL, "max_tokens": 5, "system": "Be brief. " * 60,
                                           "messages": QUESTION})
    reported_after(gateway, MODEL, time.monotonic(), idle=True)  # the reports that count both answers
    total = gateway.ready()["models"][MODEL]["workers"][0]["total_blocks"]
    assert total > 0
    free = gateway.metric("ferry_engine_kv_blocks_free", model=MODEL)
    used = gateway.metric("ferry_engine_kv_blocks_used", model=MODEL)
    assert free + used == total
    assert gateway.metric("ferry_engine_generated_tokens_total", model=MODEL) >= 10
    assert gateway.metric("ferry_engine_prefix_cache_queries_total", model=MODEL) > 0
    assert gateway.metric("ferry_engine_prefix_cache_hits_total", model=MODEL) >= 128  # a whole vLLM block
    assert gateway.metric("ferry_engine_preemptions_total", model=MODEL) == 0
    assert gateway.metric("ferry_engine_step_tokens_count", model=MODEL) > 0
    assert gateway.metric("ferry_ttft_seconds_count", model=MODEL, tier="paid") >= 2


def test_the_vllm_engine_runs_with_tcmalloc_and_intel_openmp_loaded_and_its_threads_bound(gateway):
    """As vLLM's CPU guide says (workers/vllm_preload.py), wherever this machine has them."""
    expected = preloads(VLLM_PYTHON.parent.parent)
    if not expected:
        pytest.skip("vLLM's virtualenv is not its CPU build (no libiomp5.so): nothing to preload")
    pid = engine(gateway)["pid"]
    loaded = {line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/" in line}
    assert {os.path.realpath(path) for path in expected} <= {os.path.realpath(path) for path in loaded}
    variables = open(f"/proc/{pid}/environ").read().split("\0")
    environ = dict(item.split("=", 1) for item in variables if "=" in item)
    assert (environ["OMP_PROC_BIND"], environ["OMP_PLACES"]) == ("close", "cores")


def test_a_killed_vllm_engine_ends_its_streams_with_an_error_billing_what_they_got_then_serves_again(gateway):
    seen: list[dict] = [{}, {}]

    async def run():
        async with aiohttp.ClientSession() as session:
            request = {"model": MODEL, "max_tokens": 500, "messages": STORY}
            streams = [asyncio.ensure_future(watched_stream(session, gateway.url, request, s)) for s in seen]
            await until_asyncio(lambda: all(s.get("deltas") for s in seen),  # they cannot be re-run unseen
                                "text out on both streams", within=120, every=0.05)
            os.kill(engine(gateway)["pid"], signal.SIGKILL)
            return await asyncio.gather(*streams)

    streamed = asyncio.run(run())
    for lost in streamed:
        error = lost["last"]
        assert error["type"] == "error" and error["error"]["type"] == "api_error", error
        assert "lost after" in error["error"]["message"] and lost["text"]
    lost_after = sorted(int(s["last"]["error"]["message"].split("lost after ")[1].split()[0])
                        for s in streamed)
    assert all(0 < n < 500 for n in lost_after)
    path = os.path.join(gateway.log.parent, "usage.sqlite")

    def interrupted() -> list[int] | None:  # a thread writes the records
        tokens = sorted(r.output_tokens for r in read_usage(path) if r.outcome == "interrupted")
        return tokens if len(tokens) >= 2 else None

    billed = until(interrupted, "the two interrupted streams' usage records", within=10, every=0.05)
    assert billed == lost_after  # billed exactly what each stream was told it got
    gateway.wait_for(lambda models: models[MODEL]["workers"][0]["state"] == "up", timeout=300)
    assert chat(gateway.url, MODEL, QUESTION, 8)["choices"][0]["message"]["content"]
