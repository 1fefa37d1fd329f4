"""``on_engine_loss = "resume"`` over real HTTP: ``ferry serve`` with two SmolLM2-135M engines
(float32, one thread each), eight streams on the OpenAI route, greedy and seeded, and one engine
SIGKILLed while they run. Every stream completes with no error event, its text the same as the
same request's uninterrupted answer, its usage billing each token it received once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp

from tests.support.gateway_process import PAID, Gateway, tiers_and_keys
from tests.support.waiting import until_asyncio

CONFIG = f"""
[server]
port = 0

{tiers_and_keys(60000)}

[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
workers = 2
threads = 1
num_blocks = 256
max_seqs = 16
temperature = 0.0
on_engine_loss = "resume"
"""

TOPICS = ["the sea", "a ferry", "bread", "rain", "a library", "mountains", "the moon", "trains"]


def request(index: int) -> dict:
    """Stream ``index``: a short story about its topic, greedy for even indexes, else seeded."""
    sampled = {"temperature": 0.8, "seed": 100 + index} if index % 2 else {}
    story = f"Write a short story about {TOPICS[index]}."
    return {"model": "smollm2@1", "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": story}], **sampled}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, seen: dict) -> dict:
    """One chat-completions stream: its text, its chunks with an ``error``, its finish reason."""
    seen.update(text="", errors=[], finish=None)
    headers = {"authorization": f"Bearer {PAID}"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200
        async for line in response.content:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]" or line.startswith(b":"):
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                seen["errors"].append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                seen["text"] += choice["delta"].get("content") or ""
                seen["finish"] = choice.get("finish_reason") or seen["finish"]
    return seen


def test_an_engine_killed_under_eight_streams_leaves_each_complete_and_equal_to_an_uninterrupted_run(
    tmp_path, smollm2,
):
    gateway = Gateway(tmp_path, CONFIG + f'\n[state]\ndir = "{tmp_path}"\n')
    try:
        async def run(kill: bool) -> list[dict]:
            async with aiohttp.ClientSession() as session:
                seen: list[dict] = [{} for _ in TOPICS]
                streams = [asyncio.ensure_future(stream(session, gateway.url, request(i), seen[i]))
                           for i in range(len(TOPICS))]
                if kill:
                    await until_asyncio(lambda: all(s.get("text") for s in seen), "text on every stream",
                                        within=120)
                    engines = gateway.ready()["models"]["smollm2@1"]["workers"]
                    assert engines[0]["running"] > 0  # it dies with streams that have shown text
                    os.kill(engines[0]["pid"], signal.SIGKILL)
                return await asyncio.gather(*streams)

        killed = asyncio.run(run(kill=True))
        uninterrupted = asyncio.run(run(kill=False))
        assert [s["errors"] for s in killed] == [[]] * len(TOPICS)
        assert [s["text"] for s in killed] == [s["text"] for s in uninterrupted]
        assert all(s["finish"] in ("stop", "length") and s["text"] for s in killed)
        metrics = gateway.request("GET", "/metrics")[2]["raw"].decode()
        family = 'ferry_engine_resumed_streams_total{model="smollm2@1"}'
        [resumed] = [line for line in metrics.splitlines() if line.startswith(family)]
        assert float(resumed.split()[-1]) >= 1
        assert 'ferry_engine_interrupted_streams_total{model="smollm2@1"} 0.0' in metrics
    finally:
        assert gateway.stop() == 0
