"""Per-key limits through a Redis outage, against a real redis-server stopped, frozen (SIGSTOP)
and restarted: under the limiter itself, and under a real ``ferry serve`` taking requests."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.accounting.fallback import REDIS_CONNECTIONS, FallbackLimiter
from gateway.accounting.limiter import open_limiter
from gateway.accounting.ratelimit import Limits
from gateway.accounting.usage import read_usage
from gateway.config import LimitsConfig
from tests.support.gateway_process import CONFIG, Gateway, message
from tests.support.waiting import until, until_asyncio

PLAN = Limits(tokens_per_minute=1000)
BOUND = 1.0  # seconds: far above the 50 ms timeout, far below the 10 s hangs it replaces


async def timed(call) -> tuple[object, float]:
    began = time.monotonic()
    result = await call
    return result, time.monotonic() - began


async def until_up(limiter: FallbackLimiter) -> None:
    await until_asyncio(lambda: limiter.up, "the limiter to see redis answer again", within=10, every=0.02)


async def until_refunded(url: str, key: str, level: float) -> None:
    """Until the key's bucket in Redis holds ``level`` at least: a queued refund reached it."""

    async def reached() -> bool:
        return await level_in_redis(url, key) >= level

    await until_asyncio(reached, "a queued refund to reach redis", within=10, every=0.02)


async def level_in_redis(url: str, key: str) -> float:
    client = aioredis.from_url(url)
    try:
        return float(await client.hget(f"ferry:limit:{key}", "l1"))
    finally:
        await client.aclose()


def test_the_limiter_falls_back_to_local_buckets_and_back_when_redis_is_frozen_stopped_or_restarted(
    redis_server,
):
    async def scenario():
        limiter = open_limiter(LimitsConfig(store="redis", redis_url=redis_server.url, redis_timeout_ms=50))
        assert isinstance(limiter, FallbackLimiter)
        try:
            assert (await limiter.acquire("up", PLAN, 100)).admitted and limiter.fallbacks == 0
            assert await level_in_redis(redis_server.url, "up") == pytest.approx(900, abs=1)

            redis_server.freeze()
            await limiter.refund("up", PLAN, 50)  # still believed up: sent, times out, kept for later
            verdicts = [await timed(limiter.acquire("frozen", PLAN, 100)) for _ in range(11)]
            assert max(took for _, took in verdicts) < BOUND
            assert [v.admitted for v, _ in verdicts] == [True] * 10 + [False]  # the local bucket still limits
            assert verdicts[-1][0].retry_after == pytest.approx(6.0, abs=0.5)  # 100 tokens at 1000/min
            _, took = await timed(limiter.refund("frozen", PLAN, 100))  # down: to the local bucket
            assert took < BOUND and (await limiter.acquire("frozen", PLAN, 100)).admitted
            assert (limiter.up, limiter.fallbacks) == (False, 12)
            redis_server.thaw()
            await until_up(limiter)
            await until_refunded(redis_server.url, "up", 950)  # the refund made while frozen, sent now
            assert (await limiter.acquire("up", PLAN, 100)).admitted  # in Redis again: 900 - 100 + refill
            assert await level_in_redis(redis_server.url, "up") < 900

            redis_server.stop()
            for _ in range(5):
                verdict, took = await timed(limiter.acquire("stopped", PLAN, 1))
                assert verdict.admitted and took < BOUND
            _, took = await timed(limiter.refund("stopped", PLAN, 1))
            assert took < BOUND and (limiter.up, limiter.fallbacks) == (False, 17)
            redis_server.start()  # same port, empty: the script is loaded again on first use
            await until_up(limiter)
            assert (await limiter.acquire("restarted", PLAN, 100)).admitted and limiter.fallbacks == 17
            assert await level_in_redis(redis_server.url, "restarted") == pytest.approx(900, abs=1)
        finally:
            await limiter.aclose()

    asyncio.run(scenario())


LIMITED = "sk-test-limited-0003"


def test_a_gateway_answers_every_request_and_bills_each_once_through_a_redis_outage(tmp_path, redis_server):
    state = tmp_path / "state"
    config = CONFIG + f"""
[limits]
store = "redis"
redis_url = "{redis_server.url}"
redis_timeout_ms = 50
[state]
dir = "{state}"

[[keys]]
key = "{LIMITED}"
tenant = "limited"
tier = "paid"
tokens_per_minute = 10000000
"""
    gateway = Gateway(tmp_path, config)
    try:
        results = asyncio.run(asyncio.wait_for(outage_under_load(gateway, redis_server), 60))
        until(lambda: gateway.metric("ferry_limiter_store_up") == 1,
              "the gateway's limiter to see redis again", within=10, every=0.05)
        fallbacks = gateway.metric("ferry_limiter_fallbacks_total")
    finally:
        assert gateway.stop() == 0
    assert [status for status, _, _ in results] == [200] * len(results)
    assert max(took for _, _, took in results) < 2.0  # none waited on a frozen Redis
    records = read_usage(str(state / "usage.sqlite"))
    assert sorted(r.request_id for r in records) == sorted(request_id for _, request_id, _ in results)
    assert {r.status for r in records} == {200}
    assert fallbacks >= 10  # at 40 requests/s, a second frozen and a second stopped
    lines = [line for line in gateway.log.read_text().splitlines() if " ferry.limiter " in line]
    said = [line.split(" WARNING ", 1)[1][:20] for line in lines]
    # One line as Redis stops answering (a later outage's falls in the same 10 s as the first's:
    # counted into the next, not written), one each time it answers again: twice; once where a
    # loaded machine stretched the probe's backoff past the second outage; three times where a
    # Redis starved of CPU missed a PING's deadline once more.
    assert said[:1] == ["redis did not answer"] and set(said[1:]) == {"redis answers again "}, lines
    assert 1 <= len(said[1:]) <= 3, lines


async def outage_under_load(gateway: Gateway, redis_server) -> list[tuple[int, str, float]]:
    """40 requests a second for 5 s (every fourth streamed) while Redis is frozen at 1 s, thawed
    at 2 s, stopped at 3 s and started again at 4 s: (status, request-id, seconds) of each."""
    async with aiohttp.ClientSession(headers={"x-api-key": LIMITED}) as session:

        async def one(index: int) -> tuple[int, str, float]:
            await asyncio.sleep(index / 40)  # the load's pace: 40 requests a second
            began = time.monotonic()
            body = message(f"r{index}", stream=index % 4 == 0)
            async with session.post(f"{gateway.url}/v1/messages", json=body) as reply:
                await reply.read()
                return reply.status, reply.headers["request-id"], time.monotonic() - began

        async def faults() -> None:
            for at, fault in ((1, redis_server.freeze), (2, redis_server.thaw), (3, redis_server.stop),
                              (4, redis_server.start)):
                await asyncio.sleep(at - (time.monotonic() - began))  # the faults' schedule, as the load's
                await asyncio.to_thread(fault)

        began = time.monotonic()
        results, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(200))), faults())
        return results


def test_outages_leave_no_descriptor_beyond_the_pool_and_closing_returns_them_all(redis_server):
    """The chaos suite's Redis rows end with up to 32 more descriptors than they began with: the
    pool's connections, opened by calls that ran at once and kept for reuse. Outage after outage
    they stay within the pool (and the thread's one connection); closing the limiter closes them."""

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def scenario() -> list[int]:
        limiter = open_limiter(LimitsConfig(store="redis", redis_url=redis_server.url, redis_timeout_ms=50))
        plan = Limits(tokens_per_minute=10**9)
        began = descriptors()
        seen = []
        try:
            for _ in range(3):
                for out, back in (
                    (redis_server.freeze, redis_server.thaw),
                    (redis_server.stop, redis_server.start),
                ):
                    await asyncio.gather(
                        *(limiter.acquire("k", plan, 1) for _ in range(50))
                    )  # warm: all at once
                    await asyncio.to_thread(out)
                    await asyncio.gather(*(limiter.acquire("k", plan, 1) for _ in range(50)))
                    await asyncio.to_thread(back)
                    await until_up(limiter)
                    await asyncio.gather(*(limiter.acquire("k", plan, 1) for _ in range(50)))
                    seen.append(descriptors() - began)
        finally:
            await limiter.aclose()
        seen.append(descriptors() - began)
        return seen

    grown = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert max(grown) <= REDIS_CONNECTIONS + 1, grown
    assert grown[-1] <= 0, grown  # closed: every connection given back
