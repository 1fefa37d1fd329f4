"""A busy gateway against a healthy Redis keeps every per-key limit: a call that waits for a
connection is not an outage, so no charge goes to a local bucket and no refund is lost."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import redis.asyncio as aioredis

from batcher.core.errors import Shed
from gateway.accounting.fallback import MIN_WAIT, REDIS_CONNECTIONS, FallbackLimiter
from gateway.accounting.limiter import open_limiter
from gateway.accounting.ratelimit import Limits
from gateway.config import LimitsConfig
from tests.support.gateway_process import CONFIG, Gateway, message
from tests.support.waiting import until_asyncio

BURST = 20 * REDIS_CONNECTIONS  # charges at once: far more than the connections to Redis


async def bucket(url: str, key: str) -> dict[bytes, bytes]:
    client = aioredis.from_url(url)
    try:
        return await client.hgetall(f"ferry:limit:{key}")
    finally:
        await client.aclose()


async def level(url: str, key: str) -> float:
    """What the key's bucket in Redis holds now."""
    return float((await bucket(url, key))[b"l1"])


def within_limit(per_minute: int, seconds: float) -> int:
    """The most a key may be admitted in a burst of ``seconds``: a full bucket, and its refill."""
    return int(per_minute + per_minute / 60 * seconds) + 1


def test_a_burst_of_charges_and_refunds_is_all_shared_while_redis_answers(redis_url):
    async def burst() -> None:
        limiter = open_limiter(LimitsConfig(store="redis", redis_url=redis_url, redis_timeout_ms=100))
        assert isinstance(limiter, FallbackLimiter)
        try:
            plan = Limits(requests_per_minute=300)
            began = time.monotonic()
            verdicts = await asyncio.gather(*(limiter.acquire("burst", plan, 0) for _ in range(BURST)))
            admitted = sum(v.admitted for v in verdicts)
            assert admitted <= within_limit(300, time.monotonic() - began)
            assert admitted >= 300 - limiter.late  # a charge made again may have been taken twice
            assert (limiter.up, limiter.fallbacks, limiter.failures, limiter.busy) == (True, 0, 0, 0)

            tokens = Limits(tokens_per_minute=1_000_000)
            assert (await limiter.acquire("refunds", tokens, BURST * 100)).admitted
            await asyncio.gather(*(limiter.refund("refunds", tokens, 100) for _ in range(BURST)))

            async def refunded() -> bool:  # every refund reached Redis: the bucket is full again
                return not limiter.pending and await level(redis_url, "refunds") == 1_000_000

            await until_asyncio(refunded, "every refund in Redis: the bucket full again")
            assert (limiter.up, limiter.fallbacks, limiter.failures) == (True, 0, 0)
        finally:
            await limiter.aclose()

    asyncio.run(asyncio.wait_for(burst(), 30))


LIMITED = "sk-test-limited-0004"


def test_a_gateway_under_a_burst_admits_a_limited_key_within_its_limit(tmp_path, redis_url):
    config = CONFIG + f"""
[limits]
store = "redis"
redis_url = "{redis_url}"

[[keys]]
key = "{LIMITED}"
tenant = "limited"
tier = "paid"
requests_per_minute = 300
"""
    gateway = Gateway(tmp_path, config)
    try:
        began = time.monotonic()
        statuses = asyncio.run(asyncio.wait_for(requests_at_once(gateway, BURST), 60))
        took = time.monotonic() - began
        metrics = {
            name: gateway.metric(f"ferry_limiter_{name}")
            for name in ("fallbacks_total", "busy_total", "store_failures_total", "store_up", "late_total")
        }
    finally:
        assert gateway.stop() == 0
    assert set(statuses) == {200, 429}
    assert 300 - metrics.pop("late_total") <= statuses.count(200) <= within_limit(300, took)
    assert metrics == {"fallbacks_total": 0, "busy_total": 0, "store_failures_total": 0, "store_up": 1}


async def requests_at_once(gateway: Gateway, count: int) -> list[int]:
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(headers={"x-api-key": LIMITED}, connector=connector) as session:

        async def one(index: int) -> int:
            async with session.post(f"{gateway.url}/v1/messages", json=message(f"r{index}")) as reply:
                await reply.read()
                return reply.status

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_redis_that_answers_pings_but_takes_no_charge_gets_a_529_never_a_local_charge(redis_url):
    """CLIENT PAUSE WRITE: Redis answers every PING, but holds every script that writes. That is
    not an outage, so nothing may be charged in a local bucket: the charge waits its bound, then
    is refused with a 529; a refund made meanwhile lands once Redis takes writes again."""

    async def paused() -> None:
        limiter = open_limiter(LimitsConfig(store="redis", redis_url=redis_url, redis_timeout_ms=50))
        assert isinstance(limiter, FallbackLimiter)
        plan = Limits(tokens_per_minute=1000)
        admin = aioredis.from_url(redis_url)
        try:
            assert (await limiter.acquire("paused", plan, 400)).admitted
            await admin.execute_command("CLIENT", "PAUSE", int((MIN_WAIT + 2) * 1000), "WRITE")
            await limiter.refund("paused", plan, 300)
            began = time.monotonic()
            with pytest.raises(Shed):
                await limiter.acquire("paused", plan, 100)
            assert MIN_WAIT <= time.monotonic() - began < MIN_WAIT + 1
            assert (limiter.up, limiter.fallbacks, limiter.busy) == (True, 0, 1) and limiter.late >= 1
            await admin.execute_command("CLIENT", "UNPAUSE")

            async def refunded() -> bool:  # 600 left, 300 back
                return await level(redis_url, "paused") >= 900

            await until_asyncio(refunded, "the refund made while paused in Redis once it takes writes")
            assert limiter.fallbacks == 0 and not limiter.pending
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            await admin.aclose()
            await limiter.aclose()

    asyncio.run(asyncio.wait_for(paused(), 30))
