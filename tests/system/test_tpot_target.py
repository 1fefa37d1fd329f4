"""A paid tier's TPOT target over real HTTP: ``ferry serve`` with SmolLM2-135M and step costs
given in a file, so the seat bound is the same on any machine however busy.

The file prices a decode step at 10 ms a sequence and nothing else; the paid tier promises 35 ms
a token, so the engine seats at most 3 sequences together (a fourth would price a step at 40 ms).
Tenant H streams six long answers at once; the engine's own reports (``/metrics``) show it never
running more than 3 while the others wait, and tenant L's request, sent while H holds every seat,
takes one of them (a preemption by recompute of H's newest) rather than waiting for H's to end.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from tests.support.gateway_process import FREE
from tests.support.sse_client import stream
from tests.support.tpot_gateway import tpot_gateway

LABELS = {"model": "smollm2@1", "replica": "0"}
STORY = {"model": "smollm2@1", "max_tokens": 96,
         "messages": [{"role": "user", "content": "Write a long story about a ship that crosses the sea."}]}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = tpot_gateway(tmp_path_factory.mktemp("tpot"), budget_ms=60000, target_ms=35)
    yield server
    assert server.stop() == 0


def test_the_engine_seats_what_the_target_allows_and_a_light_tenant_takes_a_seat_at_once(gateway):
    seen: dict[str, list[float]] = {"running": [], "waiting": []}
    light: dict[str, object] = {}

    def ask_light() -> None:
        light["status"] = gateway.request("POST", "/v1/messages", {**STORY, "max_tokens": 8}, key=FREE)[0]

    def watch(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            for field in seen:
                seen[field].append(gateway.metric(f"ferry_engine_{field}_sequences", 0.0, **LABELS))
            if "thread" not in light and seen["waiting"][-1] >= 1:  # H holds every seat: L asks now
                asking = light["thread"] = threading.Thread(target=ask_light, daemon=True)
                asking.start()

    async def heavy() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(stream(session, gateway.url, STORY) for _ in range(6)))

    preempted = gateway.metric("ferry_engine_preemptions_total", 0.0, **LABELS)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    answers = asyncio.run(heavy())
    stop.set()
    watcher.join()
    asking = light.get("thread")
    assert isinstance(asking, threading.Thread), f"the engine never held a sequence back: {seen}"
    asking.join(60)
    assert [answer["status"] for answer in answers] == [200] * 6
    assert max(seen["running"]) <= 3  # 4 x 10 ms > 35 ms: never a fourth seat
    assert max(seen["waiting"]) >= 1  # the bound held something back
    assert light.get("status") == 200
    assert gateway.metric("ferry_engine_preemptions_total", 0.0, **LABELS) > preempted  # L's seat, taken
