"""Admission counts the seat bound of a TPOT target, over real HTTP: ``ferry serve`` with
SmolLM2-135M and step costs given in a file, so the bound is the same on any machine.

The file prices a decode step at 10 ms a sequence and nothing else; the paid tier promises 25 ms
a token, so the engine seats 2 sequences together (a third would price a step at 30 ms). Tenant H
streams two long answers, which hold both seats; a third request of H's, beyond its share, would
wait for one of them to end, seconds over the paid tier's 500 ms budget: it gets 529 with a
Retry-After at once. Tenant L's request, sent then too, is under its share (the engine gives it
H's newest seat), so admission lets it in and it is answered.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.gateway_process import FREE, PAID
from tests.support.sse_client import stream
from tests.support.tpot_gateway import tpot_gateway

STORY = {"model": "smollm2@1", "max_tokens": 128,
         "messages": [{"role": "user", "content": "Write a long story about a ship that crosses the sea."}]}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = tpot_gateway(tmp_path_factory.mktemp("seats"), budget_ms=500, target_ms=25)
    yield server
    assert server.stop() == 0


async def ask(session: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict, dict]:
    async with session.post(url + "/v1/messages", json={**STORY, "max_tokens": 8},
                            headers={"x-api-key": key}) as response:
        return response.status, dict(response.headers), await response.json()


def test_a_request_beyond_its_tenants_seats_is_shed_at_arrival_and_another_tenants_is_answered(gateway):
    async def run() -> tuple[list[dict], tuple, tuple]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            held: list[dict] = [{}, {}]
            streams = [asyncio.create_task(stream(session, gateway.url, STORY, progress=p)) for p in held]
            while not all(p.get("times") for p in held):  # both of H's sequences hold a seat
                assert not any(s.done() for s in streams), [p.get("status") for p in held]
                await asyncio.sleep(0.02)
            heavy = await ask(session, gateway.url, PAID)
            light = await ask(session, gateway.url, FREE)
            return list(await asyncio.gather(*streams)), heavy, light

    answers, (status, headers, body), (light_status, _, light_body) = asyncio.run(run())
    assert status == 529, body
    assert body["error"]["type"] == "overloaded_error"
    assert int(headers["Retry-After"]) >= 1
    assert light_status == 200, light_body
    assert light_body["content"][0]["text"]
    assert [answer["status"] for answer in answers] == [200, 200]
