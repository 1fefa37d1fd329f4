"""Continuous mode over real HTTP: ``ferry serve`` with real engine worker processes.

The engines here are simulated (``simulated = "llama-70b"``): seeded ASCII tokens, one character
each under the ``bytes`` tokenizer, so a client's text tells exactly how many tokens it got; each
step takes what a 70B model on 8 x H100 would (5 ms or more), so streams stay alive long enough
to be cut or killed, and a 1,000-token prompt fits (the tiny checkpoint's context is 256). The
SDK, interleaved streams and stop sequences with the tiny checkpoint, and SmolLM2, are in
``tests/system/test_continuous_model.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.engine_reports import IDLE, reported_after
from tests.support.gateway_process import PAID, Gateway
from tests.support.sse_client import message_id, stream
from tests.support.usage_records import records
from tests.support.waiting import until, until_asyncio

CONFIG = f"""
[server]
port = 0
ping_interval_ms = 200
shutdown_grace_ms = 2000

[[tiers]]
name = "paid"
wait_budget_ms = 20000
[[tiers]]
name = "free"
wait_budget_ms = 1000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"

[[models]]
name = "sim@1"
mode = "continuous"
simulated = "llama-70b"
workers = 2
num_blocks = 512
max_batch_tokens = 64
max_seqs = 64
"""


def start(tmp, config: str = CONFIG) -> Gateway:
    return Gateway(tmp, config + f'\n[state]\ndir = "{tmp}"\n')


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = start(tmp_path_factory.mktemp("continuous"))
    yield server
    assert server.stop() == 0


def body(text: str, max_tokens: int, **fields) -> dict:
    return {
        "model": "sim@1",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        **fields,
    }


def whole(gateway: Gateway, request: dict) -> dict:
    status, _, reply = gateway.request("POST", "/v1/messages", request)
    assert status == 200, reply
    return reply


def engines(gateway: Gateway) -> list[dict]:
    return gateway.ready()["models"]["sim@1"]["workers"]


def test_a_stop_sequence_split_across_two_tokens_ends_the_answer_unshown_and_bills_the_text_before_it(
    gateway,
):
    request = body("tell me something", 30)
    text = whole(gateway, request)["content"][0]["text"]
    at = next(i for i in range(3, 20) if text.find(text[i : i + 2]) == i)
    stop = text[at : at + 2]  # two characters: two tokens, two frames, two deltas
    reply = whole(gateway, {**request, "stop_sequences": [stop]})
    assert (reply["content"][0]["text"], reply["stop_reason"], reply["stop_sequence"]) == (
        text[:at],
        "stop_sequence",
        stop,
    )
    assert reply["usage"]["output_tokens"] == at
    streamed = asyncio.run(_one_stream(gateway, {**request, "stop_sequences": [stop]}))
    assert streamed["text"] == text[:at] and stop not in "".join(streamed["text"])
    delta = next(data for name, data in streamed["events"] if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert delta["usage"]["output_tokens"] == at


async def _one_stream(gateway, request):
    async with aiohttp.ClientSession() as session:
        return await stream(session, gateway.url, request)


def test_two_hundred_clients_that_leave_mid_stream_leave_no_sequence_and_no_block_behind(gateway):
    async def leave():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(
                *(stream(session, gateway.url, body(f"client {i}", 400), leave_after=2) for i in range(200))
            )

    results = asyncio.run(leave())
    assert all(r["status"] == 200 and len(r["text"]) >= 2 for r in results), [
        (r["status"], r["events"][-1:]) for r in results if r["status"] != 200
    ][:3]
    gateway.wait_for(lambda models: not any(w[name] for w in models["sim@1"]["workers"] for name in IDLE),
                     what="no sequence, no block and nothing owed left on any replica")
    left = records(gateway, {message_id(r) for r in results})
    assert len(left) == 200 and {(r.status, r.outcome) for r in left.values()} == {(499, "cancelled")}


def test_a_repeated_long_system_prompt_hits_the_prefix_cache_of_the_replica_holding_it(gateway):
    system = " ".join(f"rule {i} is to be kind." for i in range(60))[:1000]  # 1,000 prompt tokens
    shared = (
        len(f"System: {system}\n\nUser: ".encode()) // 16 * 16
    )  # the full blocks every such prompt shares

    async def run():
        async with aiohttp.ClientSession() as session:
            async def cache(after: float, idle: bool = False) -> dict[str, dict[str, float]]:
                """Prefix-cache figures by replica, from engine reports taken after ``after``."""
                await asyncio.to_thread(reported_after, gateway, "sim@1", after, idle)
                return prefix_cache(await (await session.get(gateway.url + "/metrics")).text())

            start = await cache(time.monotonic(), idle=True)  # whatever ran before is counted
            cold = await stream(session, gateway.url, {**body("first question", 5), "system": system})
            after_cold = await cache(time.monotonic(), idle=True)
            # The holder gets a long stream with the same system prompt: busier than the other
            # replica, but within the bound, so the next request still goes there.
            holding: dict = {}
            busy = asyncio.ensure_future(
                stream(session, gateway.url, {**body("keep busy", 300), "system": system}, progress=holding)
            )
            await until_asyncio(lambda: holding.get("at"), "the busy stream's first text")
            after_busy = await cache(holding["at"][0])
            warm = await stream(session, gateway.url, {**body("second question", 5), "system": system})
            after_warm = await cache(time.monotonic())
            await busy
            return cold, warm, [start, after_cold, after_busy, after_warm]

    cold, warm, (start, after_cold, after_busy, after_warm) = asyncio.run(run())
    holder = max(start["queries"], key=lambda r: after_cold["queries"][r] - start["queries"][r])
    other = "1" if holder == "0" else "0"
    assert after_cold["hits"][holder] == start["hits"][holder]  # the cold prompt computed every block
    assert after_busy["hits"][holder] - after_cold["hits"][holder] == shared == 63 * 16
    assert after_warm["hits"][holder] - after_busy["hits"][holder] == shared
    assert after_warm["queries"][other] == start["queries"][other]  # nothing went to the other replica
    assert warm["times"][0] < cold["times"][0]  # 63 blocks not computed again: 15 steps fewer


def prefix_cache(text: str) -> dict[str, dict[str, float]]:
    """Prefix-cache queries and hits of the model, by replica."""
    found: dict[str, dict[str, float]] = {"queries": {}, "hits": {}}
    for family in text_string_to_metric_families(text):
        kind = {"ferry_engine_prefix_cache_queries": "queries", "ferry_engine_prefix_cache_hits": "hits"}.get(
            family.name
        )
        for sample in family.samples if kind else ():
            if sample.labels.get("model") == "sim@1":
                found[kind][sample.labels["replica"]] = sample.value
    return found


FAMILIES = {
    "ferry_requests": "counter", "ferry_ttft_seconds": "histogram",
    "ferry_time_per_output_token_seconds": "histogram", "ferry_request_latency_seconds": "histogram",
    "ferry_queue_wait_seconds": "histogram", "ferry_engine_running_sequences": "gauge",
    "ferry_engine_waiting_sequences": "gauge", "ferry_engine_kv_blocks_free": "gauge",
    "ferry_engine_kv_blocks_used": "gauge", "ferry_engine_preemptions": "counter",
    "ferry_engine_prefix_cache_queries": "counter", "ferry_engine_prefix_cache_hits": "counter",
    "ferry_engine_step_tokens": "histogram", "ferry_engine_generated_tokens": "counter",
    "ferry_engine_generation_tokens_per_second": "gauge", "ferry_worker_restarts": "counter",
    "ferry_engine_reruns": "counter", "ferry_engine_interrupted_streams": "counter",
    "ferry_admission_rejects": "counter", "ferry_queued_tokens": "gauge",
}


def test_metrics_parse_and_show_every_family_after_a_short_run(gateway):
    for i in range(3):
        whole(gateway, body(f"metrics {i}", 20))
    asyncio.run(_one_stream(gateway, body("metrics stream", 20)))

    def sample(family: str, suffix: str = "", **labels) -> float:
        return sum(s.value for s in (families[family].samples if family in families else ())
                   if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    def reported() -> bool:
        nonlocal families
        raw = gateway.request("GET", "/metrics")[2]
        families = {f.name: f for f in text_string_to_metric_families(raw["raw"].decode())}
        return (sample("ferry_engine_generated_tokens", "_total", model="sim@1") >= 80
                and sample("ferry_engine_step_tokens", "_count", model="sim@1") > 0)

    families: dict = {}
    until(reported, "the engines' reports of the run's steps", within=10, every=0.05)
    assert {name: families[name].type for name in FAMILIES} == FAMILIES

    assert sample("ferry_ttft_seconds", "_count", model="sim@1", tier="paid") >= 4
    assert sample("ferry_time_per_output_token_seconds", "_count", model="sim@1", tier="paid") >= 4
    assert sample("ferry_queue_wait_seconds", "_count", model="sim@1", tier="paid") >= 4
    assert sample("ferry_engine_generated_tokens", "_total", model="sim@1") >= 80
    assert sample("ferry_engine_step_tokens", "_count", model="sim@1") > 0
    assert sample("ferry_engine_kv_blocks_free", model="sim@1") + sample(
        "ferry_engine_kv_blocks_used", model="sim@1") == 2 * 512
    assert sample("ferry_engine_prefix_cache_queries", "_total", model="sim@1") > 0


def test_killing_an_engine_ends_its_streams_with_an_error_and_completes_the_rest_billing_what_was_received(
    tmp_path,
):
    gateway = start(tmp_path)
    try:
        async def run():
            async with aiohttp.ClientSession() as session:
                shown: list[dict] = [{} for _ in range(4)]
                streams = [asyncio.ensure_future(stream(session, gateway.url, body(f"stream {i}", 300),
                                                        progress=shown[i])) for i in range(4)]
                await until_asyncio(lambda: all(s.get("text") for s in shown),
                                    "text on every stream")  # streams 0, 2 on replica 0; 1, 3 on replica 1
                loop = asyncio.get_running_loop()
                wholes = [
                    loop.run_in_executor(
                        None, gateway.request, "POST", "/v1/messages", body(f"whole {i}", 150)
                    )
                    for i in range(4)
                ]  # two on each replica, by their loads

                def running(models: dict) -> bool:  # each engine runs two streams and two whole answers
                    return [w["running"] for w in models["sim@1"]["workers"]] == [4, 4]

                await asyncio.to_thread(gateway.wait_for, running, what="four sequences on each engine")
                os.kill(engines(gateway)[0]["pid"], signal.SIGKILL)
                return await asyncio.gather(*streams), await asyncio.gather(*wholes)

        streamed, wholes = asyncio.run(run())
        errors = [r for r in streamed if r["events"][-1][0] == "error"]
        finished = [r for r in streamed if r["events"][-1][0] == "message_stop"]
        assert len(errors) == 2 and len(finished) == 2
        for lost in errors:
            error = lost["events"][-1][1]["error"]
            assert error["type"] == "api_error" and "lost after" in error["message"] and lost["text"]
        assert all(len(r["text"]) == 300 for r in finished)
        assert all(status == 200 and len(reply["content"][0]["text"]) == 150 for status, _, reply in wholes)
        got = {message_id(r): len(r["text"]) for r in streamed}
        got.update({reply["id"]: len(reply["content"][0]["text"]) for _, _, reply in wholes})
        usage = records(gateway, set(got))
        assert {rid: usage[rid].output_tokens for rid in got} == got  # exactly what each client received
        assert sorted(r.outcome for r in usage.values()) == ["completed"] * 6 + ["interrupted"] * 2
        metrics = gateway.request("GET", "/metrics")[2]["raw"].decode()
        assert 'ferry_engine_interrupted_streams_total{model="sim@1"} 2.0' in metrics
        assert 'ferry_engine_reruns_total{model="sim@1"} 2.0' in metrics
    finally:
        assert gateway.stop() == 0
