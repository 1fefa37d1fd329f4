"""What the KV hand-off's system tests share (``tests/system/test_kv_handoff*.py``): the SmolLM2
engine lines of a model table, the requests (a short story a topic, greedy), streaming them at
once with an engine SIGKILLed at a chosen moment, and a stream's error events."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp

from tests.support.gateway_process import Gateway
from tests.support.sse_client import stream
from tests.support.waiting import until_asyncio

ENGINE = """
mode = "continuous"
model = "smollm2-135m"
threads = 1
num_blocks = 512
max_seqs = 16
temperature = 0.0
"""

TOPICS = ["the sea", "a ferry", "bread", "rain", "a library", "mountains", "the moon", "trains"]


def request(model: str, index: int, context: str = "") -> dict:
    """Request ``index``: a short story about its topic, greedy (seeded sampling through a
    hand-off: tests/engine/test_kv_handoff.py)."""
    story = f"{context}Write a short story about {TOPICS[index]}."
    return {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": story}]}


async def streams(gateway: Gateway, requests: list[dict], kill: int | None = None) -> list[dict]:
    """``requests`` streamed at once; with ``kill``, ``apart@1``'s engine of that slot is
    SIGKILLed once some streams show text (all of them, for the decode engine) while, for the
    prefill engine, others have none yet."""
    async with aiohttp.ClientSession() as session:
        seen: list[dict] = [{} for _ in requests]
        running = [asyncio.ensure_future(stream(session, gateway.url, body, progress=result))
                   for body, result in zip(requests, seen, strict=True)]
        if kill is not None:
            def moment() -> bool:
                shown = [bool(result.get("text")) for result in seen]
                return all(shown) if kill else any(shown) and not all(shown)

            await until_asyncio(moment, "the moment to kill the engine", within=180)
            engine = gateway.ready()["models"]["apart@1"]["workers"][kill]
            os.kill(engine["pid"], signal.SIGKILL)
        return await asyncio.gather(*running)


def errors(result: dict) -> list:
    return [data for name, data in result["events"] if name == "error"]
