"""SmolLM2 at ``min_workers = 0`` over a real ``ferry serve``, real engine processes and real
HTTP: it is ready (takes traffic) with no engine until its first request, which waits for one
to start (its paid budget is longer than a start) and is answered; the engine stops after
``idle_after_s``, and the version is still ready; then a free request, whose budget is shorter
than the measured start, gets 503 ``overloaded_error`` with ``Retry-After`` the time to ready,
in both the Anthropic and OpenAI shapes, while an engine starts for the requests that follow."""

from __future__ import annotations

import math

from tests.support.gateway_process import FREE, Gateway, message, tiers_and_keys

CONFIG = f"""
[server]
port = 0
ping_interval_ms = 200

{tiers_and_keys(120000, 200)}

[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
max_batch_tokens = 256
kv_memory_gb = 0.25
temperature = 0.0
min_workers = 0
max_workers = 1
idle_after_s = 1.0
"""


def engines(models: dict) -> list:
    return models["smollm2@1"]["workers"]


def test_smollm2_at_zero_starts_for_its_first_request_stops_when_idle_and_tells_a_short_budget_when(tmp_path):
    gateway = Gateway(tmp_path, CONFIG)
    try:
        empty = gateway.ready()
        before = engines(empty["models"])
        question = message("What is the capital of France?", model="smollm2@1", max_tokens=20)
        status, _, first = gateway.request("POST", "/v1/messages", question)
        started = gateway.ready()["models"]["smollm2@1"]
        measured = started["start_seconds"]
        idle = gateway.wait_for(lambda models: not engines(models), timeout=30, what="the engine stopped")
        refused = gateway.request("POST", "/v1/messages", question, key=FREE)
        chat = {"model": "smollm2@1", "max_tokens": 20, "messages": question["messages"]}
        refused_openai = gateway.request("POST", "/v1/chat/completions", chat, key=FREE)
        gateway.wait_for(lambda models: engines(models) and engines(models)[0]["pid"], timeout=60,
                         what="an engine started for the refused requests")
    finally:
        assert gateway.stop() == 0
    assert before == [] and empty["ready"]  # at zero it takes traffic: a load balancer keeps sending it
    assert idle["smollm2@1"]["ready"] and idle["smollm2@1"]["reason"] == ""
    assert status == 200 and "Paris" in first["content"][0]["text"]
    assert measured > 0 and started["scaling"] == "up 0 -> 1 (cold): work arrived with no worker"
    assert idle["smollm2@1"]["scaling"] == "down 1 -> 0 (idle): no work for 1s"
    code, headers, body = refused
    assert (code, body["error"]["type"]) == (503, "overloaded_error")
    assert 1 <= int(headers["Retry-After"]) <= math.ceil(measured) + 1
    code, headers, body = refused_openai
    assert code == 503 and body["error"]["code"] == "overloaded" and int(headers["Retry-After"]) >= 1
