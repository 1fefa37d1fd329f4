"""A fixed-mode model that scales, over a real ``ferry serve``, real worker processes and real
HTTP: at ``min_workers = 1, max_workers = 4`` a burst of paid traffic at three times one worker's
capacity grows the fleet to four workers and every request is answered within its budget; after
the burst it shrinks back to one, losing nothing, and says why in ``/readyz``, ``ferry status``,
``/metrics`` and its log.

One worker answers a call of up to 4 requests in 200 ms: 20 requests/s; the burst is 60/s."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from tests.support.gateway_process import PAID, Gateway, ferry, message

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
