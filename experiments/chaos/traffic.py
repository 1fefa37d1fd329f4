"""Open-loop traffic for a chaos scenario, every answer kept whole for the checks.

Requests arrive on a Poisson schedule whatever the gateway is doing, from this process's aiohttp
client, to 127.0.0.1 only, bounded in count (the schedule) and in time (each request's timeout).
Each request's text is unique (``chaos 000123 ...``), so its answer names it: a reference
worker answers its prompt reversed, and an answer that is anyone else's is cross-talk. A share
of the clients give up on purpose: ``queue`` ones close the connection before any answer,
``stream`` ones after the first bytes of their stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import aiohttp
import numpy as np

from batcher.sim.arrivals import poisson


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to send: rate and duration, the mix, and who gives up on purpose."""

    rate: float = 300.0
    duration: float = 10.0
    paid_share: float = 0.5
    stream_share: float = 0.3
    poison_share: float = 0.0  # inputs carrying the poison marker
    poison: str = "POISON"
    give_up_share: float = 0.0  # clients that leave mid-queue or mid-stream
    burst: tuple[float, float, float] | None = None  # (start s, length s, rate multiplier)
    quiet: tuple[float, float] | None = None  # (start s, length s) with no arrival
    max_tokens: int = 256
    timeout: float = 30.0
    seed: int = 0

    def times(self) -> np.ndarray:
        times = poisson(self.rate, self.duration, self.seed)
        if self.burst is not None:
            start, length, factor = self.burst
            extra = poisson(self.rate * (factor - 1), length, self.seed + 1) + start
            times = np.sort(np.concatenate([times, extra]))
        if self.quiet is not None:
            start, length = self.quiet
            times = times[(times < start) | (times >= start + length)]
        return times


@dataclasses.dataclass(slots=True)
class Shot:
    """One request and everything its client saw."""

    index: int
    tier: str
    stream: bool
    text: str
    scheduled: float  # loop time of its scheduled arrival
    give_up: str | None = None  # "queue" or "stream": the client left on purpose
    status: int | None = None
    request_id: str | None = None
    retry_after: str | None = None
    body: dict | None = None  # a whole answer's JSON, or an error's
    events: list[tuple[str, dict]] = dataclasses.field(default_factory=list)  # a stream's SSE
    output: str | None = None  # the answer's text (joined deltas for a stream)
    failure: str | None = None  # no answer: the exception's name
    finished: float | None = None  # loop time of its last byte (or of its failure)
    succeeded: bool = False  # set by the checks: a whole, well-formed answer of its own

    @property
    def latency(self) -> float | None:
        return None if self.finished is None or self.status is None else self.finished - self.scheduled


def shots(plan: Plan, start: float) -> list[Shot]:
    draw = random.Random(plan.seed)
    made = []
    for index, offset in enumerate(plan.times().tolist()):
        text = f"chaos {index:06d} {draw.randrange(16 ** 6):06x}"
        if draw.random() < plan.poison_share:
            text += f" {plan.poison}"
        stream = draw.random() < plan.stream_share
        give_up = None
        if draw.random() < plan.give_up_share:
            give_up = "stream" if stream else "queue"
        tier = "paid" if draw.random() < plan.paid_share else "free"
        made.append(Shot(index, tier, stream, text, start + offset, give_up))
    return made


async def send(plan: Plan, url: str, keys: dict[str, str], model: str, lead: float = 0.2) -> list[Shot]:
    """Offer every request of ``plan`` on time; return them all once every one has ended."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=plan.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    made = shots(plan, loop.time() + lead)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for shot in made:
            delay = shot.scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_one(session, url, keys[shot.tier], model, plan, shot)))
        await asyncio.gather(*tasks)
    return made


async def send_one(url: str, key: str, model: str, shot: Shot, plan: Plan = Plan()) -> Shot:
    """One request, on a session of its own: a fault's own client, judged with the traffic."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=plan.timeout)) as session:
        await _one(session, url, key, model, plan, shot)
    return shot


async def _one(
    session: aiohttp.ClientSession, url: str, key: str, model: str, plan: Plan, shot: Shot
) -> None:
    body = {"model": model, "max_tokens": plan.max_tokens, "stream": shot.stream,
            "messages": [{"role": "user", "content": shot.text}]}
    loop = asyncio.get_running_loop()
    try:
        if shot.give_up == "queue":
            await _leave_early(session, url, key, body)
            return
        async with session.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key}) as reply:
            shot.status = reply.status
            shot.request_id = reply.headers.get("request-id")
            shot.retry_after = reply.headers.get("Retry-After")
            if reply.content_type == "text/event-stream":
                await _read_stream(reply, shot)
            else:
                raw = await reply.read()
                shot.body = (
                    json.loads(raw) if reply.content_type == "application/json" else {"raw": raw.decode()}
                )
                if shot.status == 200:
                    shot.output = "".join(block.get("text", "") for block in shot.body.get("content", []))
        shot.finished = loop.time()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        shot.failure = type(exc).__name__
        shot.finished = loop.time()


async def _read_stream(reply: aiohttp.ClientResponse, shot: Shot) -> None:
    parts = []
    async for block in _sse_blocks(reply.content):
        name, _, data = block.partition("\ndata: ")
        event = (name.removeprefix("event: "), json.loads(data))
        shot.events.append(event)
        if event[0] == "content_block_delta":
            parts.append(event[1]["delta"]["text"])
        if shot.give_up == "stream":
            return  # the first event has arrived: this client leaves now
    shot.output = "".join(parts)


async def _sse_blocks(content: aiohttp.StreamReader):
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            yield block.decode()


async def _leave_early(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> None:
    """Send the request, then close the connection before any answer can come."""
    try:
        async with session.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key},
                                timeout=aiohttp.ClientTimeout(total=0.05)):
            pass
    except TimeoutError:
        pass
