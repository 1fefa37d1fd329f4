"""A fixed-mode model that scales, over a real ``ferry serve``, real worker processes and real
HTTP: at ``min_workers = 1, max_workers = 4`` a burst of paid traffic at three times one worker's
capacity grows the fleet to four workers and every request is answered within its budget; after
the burst it shrinks back to one, losing nothing, and says why in ``/readyz``, ``ferry status``,
``/metrics`` and its log. At ``min_workers = 0`` the version's first request waits for a cold
start and is answered; once idle it stops, and a request whose budget is shorter than the
measured start gets 503 ``overloaded_error`` with ``Retry-After`` (both API shapes).

One worker answers a call of up to 4 requests in 200 ms: 20 requests/s; the burst is 60/s."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time

import pytest

from tests.support.gateway_process import FREE, PAID, Gateway, ferry, message, tiers_and_keys

CONFIG = f"""
[server]
host = "127.0.0.1"
port = 0
ping_interval_ms = 100

[[tiers]]
name = "paid"
wait_budget_ms = 3000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"

[[models]]
name = "elastic@1"
worker = ["sleep", "--latency-ms", "200"]
min_workers = 1
max_workers = 4
max_batch = 4
max_wait_ms = 10
scale_down_after_s = 1.0
"""

RATE, SECONDS = 60.0, 6.0


@pytest.fixture
def gateway(tmp_path):
    server = Gateway(tmp_path, CONFIG)
    yield server
    assert server.stop() == 0


def serving(gateway: Gateway) -> int:
    return len(gateway.ready()["models"]["elastic@1"]["workers"])


def burst(gateway: Gateway) -> list[tuple[int, dict, float]]:
    """Open-loop paid requests at RATE for SECONDS: each one's status, body and seconds taken."""

    def one(index: int) -> tuple[int, dict, float]:
        sent = time.monotonic()
        status, _, body = gateway.request("POST", "/v1/messages", message(f"<{index}>", model="elastic@1"))
        return status, body, time.monotonic() - sent

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=128) as pool:
        futures = []
        for index in range(round(RATE * SECONDS)):
            time.sleep(max(0.0, start + index / RATE - time.monotonic()))  # the arrival schedule
            futures.append(pool.submit(one, index))
        return [future.result() for future in futures]


def test_a_burst_grows_the_fleet_to_max_within_budget_and_it_shrinks_back_to_min_losing_nothing(gateway):
    assert serving(gateway) == 1
    sizes: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            sizes.append(serving(gateway))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answers = burst(gateway)
    finally:
        done.set()
        watcher.join()
    grown = max(sizes)
    shrunk = gateway.wait_for(lambda models: len(models["elastic@1"]["workers"]) == 1, what="one worker")
    status = ferry(gateway, "status").stdout
    events = {(way, cause): gateway.metric("ferry_scale_events_total", absent=0.0, model="elastic@1",
                                           direction=way, cause=cause)
              for way, cause in (("up", "wait"), ("up", "demand"), ("down", "spare"))}
    serving_gauge = gateway.metric("ferry_workers", model="elastic@1", state="serving")

    assert grown == 4
    assert [code for code, _, _ in answers] == [200] * len(answers)  # none shed, none lost
    # each answer is its own prompt's, reversed by the worker
    assert all(f"<{i}>"[::-1] in body["content"][0]["text"] for i, (_, body, _) in enumerate(answers))
    assert max(seconds for _, _, seconds in answers) < 3.0  # the paid budget
    last = shrunk["elastic@1"]["scaling"]
    assert last.startswith("down ") and "-> 1 (spare): spare capacity for 1s" in last
    assert "elastic@1 scaled down" in status and "1/1" in status
    assert events["up", "wait"] + events["up", "demand"] >= 1 and events["down", "spare"] >= 1
    assert serving_gauge == 1
    assert "elastic@1: scaling up 1 -> " in gateway.log.read_text()


AT_ZERO = f"""
[server]
host = "127.0.0.1"
port = 0
ping_interval_ms = 100

{tiers_and_keys(60000, 20)}

[[models]]
name = "rare@1"
worker = ["sleep", "--latency-ms", "10"]
min_workers = 0
max_workers = 1
idle_after_s = 1.0
"""


def test_a_fixed_model_at_zero_cold_starts_for_its_first_request_and_refuses_a_short_budget_with_503(
        tmp_path):
    gateway = Gateway(tmp_path, AT_ZERO)
    try:
        empty = gateway.ready()["models"]["rare@1"]
        status, _, first = gateway.request("POST", "/v1/messages", message("<first>", model="rare@1"))
        measured = gateway.ready()["models"]["rare@1"]["start_seconds"]
        gateway.wait_for(lambda models: not models["rare@1"]["workers"], what="the worker stopped")
        refused = gateway.request("POST", "/v1/messages", message("<short>", model="rare@1"), key=FREE)
        chat = {"model": "rare@1", "max_tokens": 20, "messages": [{"role": "user", "content": "<short>"}]}
        refused_openai = gateway.request("POST", "/v1/chat/completions", chat, key=FREE)
        gateway.wait_for(lambda models: models["rare@1"]["workers"], what="a worker started for the refused")
    finally:
        assert gateway.stop() == 0
    assert empty["ready"] and empty["workers"] == []
    assert status == 200 and ">tsrif<" in first["content"][0]["text"]
    assert measured > 0.02  # a process start is longer than the free tier's budget
    code, headers, body = refused
    assert (code, body["error"]["type"]) == (503, "overloaded_error")
    assert 1 <= int(headers["Retry-After"]) <= math.ceil(measured) + 1
    code, headers, body = refused_openai
    assert code == 503 and body["error"]["code"] == "overloaded" and int(headers["Retry-After"]) >= 1
