"""Two fixed-mode versions sharing one slot (``[[pools]]``) over a real ``ferry serve``, real
worker processes and real HTTP: a request to the version with no worker evicts the idle one
(``/readyz`` says so) and is answered; while the other version is busy in the slot, a request
whose budget is shorter than a start gets 503 ``overloaded_error`` with ``Retry-After``, and a
patient one waits for the slot and is answered once the busy call has ended, which it did."""

from __future__ import annotations

import concurrent.futures
import time

from tests.support.gateway_process import FREE, Gateway, message, tiers_and_keys

CONFIG = f"""
[server]
host = "127.0.0.1"
port = 0
ping_interval_ms = 100

{tiers_and_keys(60000, 20)}

[[pools]]
name = "rare"
slots = 1

[[models]]
name = "quick@1"
worker = ["sleep", "--latency-ms", "10"]
pool = "rare"
idle_after_s = 600

[[models]]
name = "slow@1"
worker = ["sleep", "--latency-ms", "3000"]
pool = "rare"
max_batch = 1
idle_after_s = 600
"""


def in_call(models: dict) -> bool:
    return any(worker["state"] == "busy" for worker in models["slow@1"]["workers"])


def test_versions_take_turns_on_a_slot_an_idle_one_is_evicted_a_busy_one_never(tmp_path):
    gateway = Gateway(tmp_path, CONFIG)
    ask = gateway.request
    try:
        first = ask("POST", "/v1/messages", message("<q1>", model="quick@1"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            slow = pool.submit(ask, "POST", "/v1/messages", message("<s1>", model="slow@1"))
            busy = gateway.wait_for(in_call, what="slow@1 in its call")
            refused = ask("POST", "/v1/messages", message("<q2>", model="quick@1"), key=FREE)
            sent = time.monotonic()
            patient = ask("POST", "/v1/messages", message("<q3>", model="quick@1"))
            waited = time.monotonic() - sent
            slow_answer = slow.result()
        evicted = gateway.ready()["models"]["slow@1"]
    finally:
        assert gateway.stop() == 0
    assert first[0] == 200 and ">1q<" in first[2]["content"][0]["text"]
    assert busy["quick@1"]["workers"] == [] and "(evicted)" in busy["quick@1"]["scaling"]
    code, headers, body = refused
    assert (code, body["error"]["type"]) == (503, "overloaded_error") and int(headers["Retry-After"]) >= 1
    assert slow_answer[0] == 200 and ">1s<" in slow_answer[2]["content"][0]["text"]  # not stopped in its call
    assert patient[0] == 200 and ">3q<" in patient[2]["content"][0]["text"] and waited > 0.5
    assert evicted["workers"] == [] and "slot goes to quick@1" in evicted["scaling"]
