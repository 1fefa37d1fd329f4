"""The Redis limiter against a real redis-server: same verdicts as the core, shared by processes."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import uuid

import pytest
import trio

from gateway.accounting.limiter import MemoryLimiter, RedisLimiter
from gateway.accounting.ratelimit import Limits


def test_the_lua_script_gives_the_verdicts_of_the_pure_core(redis_url):
    asyncio.run(compare_with_the_core(redis_url))  # redis.asyncio runs on asyncio, not trio


async def compare_with_the_core(redis_url: str) -> None:
    clock = [1_000.0]
    redis = RedisLimiter.from_url(redis_url, prefix=f"test:{uuid.uuid4().hex}:", clock=lambda: clock[0])
    memory = MemoryLimiter(clock=lambda: clock[0])
    plans = [Limits(600, 5), Limits(tokens_per_minute=1000), Limits(requests_per_minute=3), Limits()]
    rng = random.Random(7)
    try:
        for step in range(400):
            clock[0] += rng.choice([0.0, 0.01, 0.5, 3.0, 20.0])
            key, plan = rng.choice([("a", plans[0]), ("b", plans[1]), ("c", plans[2]), ("d", plans[3])])
            tokens = rng.choice([1, 50, 300, 599, 2000])
            if rng.random() < 0.3:
                await redis.refund(key, plan, tokens)
                await memory.refund(key, plan, tokens)
                continue
            want, got = await memory.acquire(key, plan, tokens), await redis.acquire(key, plan, tokens)
            assert got.admitted == want.admitted, f"step {step}"
            assert got.retry_after == pytest.approx(want.retry_after, rel=1e-9), f"step {step}"
            assert got.levels == pytest.approx(want.levels, rel=1e-9), f"step {step}"
    finally:
        await redis.aclose()


CONTENDER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from gateway.accounting.limiter import LeasedLimiter, RedisLimiter
    from gateway.accounting.ratelimit import Limits

    async def main(url, key, leased):
        limiter = RedisLimiter.from_url(url)
        if leased:
            limiter = LeasedLimiter(limiter, share=0.05)
        await limiter.refund(key, Limits(tokens_per_minute=6000), 0)  # connect before the start
        print("ready", flush=True)
        sys.stdin.readline()  # the start, once every contender is ready
        plan, admitted, began = Limits(tokens_per_minute=6000), 0, time.time()
        while time.time() - began < 1.5:
            if (await limiter.acquire(key, plan, 7)).admitted:
                admitted += 7
        print(json.dumps({"admitted": admitted, "began": began, "ended": time.time()}))

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "leased"))
    """
)


async def said(process: trio.Process) -> bytes:
    """The next line a contender writes."""
    line = b""
    while not line.endswith(b"\n"):
        data = await process.stdout.receive_some(1)
        assert data, f"the contender exited with {await process.wait()} after {line!r}"
        line += data
    return line


@pytest.mark.parametrize("mode", ["direct", "leased"])
async def test_two_gateway_processes_never_admit_more_than_the_limit_together(redis_url, mode):
    key = f"shared-{uuid.uuid4().hex}"
    argv = [sys.executable, "-c", CONTENDER, redis_url, key, mode]
    contenders = [await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                  for _ in range(2)]
    try:
        with trio.fail_after(60):
            for contender in contenders:  # both begin together, once both are connected
                assert await said(contender) == b"ready\n"
            for contender in contenders:
                await contender.stdin.send_all(b"go\n")
            results = [json.loads(await said(contender)) for contender in contenders]
            assert [await contender.wait() for contender in contenders] == [0, 0]
    finally:
        for contender in contenders:
            if contender.returncode is None:  # cut short
                contender.kill()
            await contender.wait()
            await contender.stdin.aclose()
            await contender.stdout.aclose()
    began = min(r["began"] for r in results)
    ended = max(r["ended"] for r in results)
    refilled = (ended - began) * 6000 / 60  # the bucket refills 100 tokens/s while they run
    total = sum(r["admitted"] for r in results)
    assert total <= 6000 + refilled
    assert total >= 6000 - 7 * 2 * (1 if mode == "direct" else 50)  # and the budget was really used
    assert all(r["admitted"] > 0 for r in results)
