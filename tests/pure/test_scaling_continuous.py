"""A continuous model at ``min_workers = 0``, over the production engine pool and simulated
engines that take 8 s to start, in virtual time (MockClock): the first request starts a replica
and waits for it, the replica stops after ``idle_after_s``, and a request whose wait budget is
shorter than the measured start is refused at once (503's error, ``Retry-After`` the time to
ready) while a replica starts for the requests after it; a warm replica takes the first request
with no start."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.mode import open_continuous
from batcher.core.backend import Failed, Finished
from batcher.core.config import QueueConfig
from batcher.core.errors import Starting
from batcher.core.scaling import TICK
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import Client, job

START = 8.0
QUEUE = QueueConfig(wait_budgets=(10.0, 2.0))  # paid waits out a start, free does not


def model(**keys) -> ContinuousModelConfig:
    return ContinuousModelConfig(name="sim@1", simulated="llama-70b", num_blocks=64, max_batch_tokens=64,
                                 max_seqs=16, min_workers=0, max_workers=1, idle_after_s=30.0, **keys)


async def test_a_version_at_zero_starts_for_its_first_request_stops_when_idle_and_refuses_a_short_budget(
        autojump_clock):
    config = model()
    spawn = SimulatedEngines(EngineSpec.of(config), start_s=START)
    async with open_continuous(config, QUEUE, spawn, ByteTokenizer()) as pool:
        await trio.sleep(5.0)
        empty = (len(spawn.spawned), pool.snapshot().status.workers)
        first, arrived = Client(), trio.current_time()
        pool.submit(job(1, 8, stream=False), first)
        await first.done.wait()
        waited = first.ended - arrived
        measured = pool.snapshot().status.details["start_seconds"]
        await trio.sleep(31.0)
        stopped = (pool.fleet().serving, pool.snapshot().status.scaling)
        free, arrived = Client(), trio.current_time()
        pool.submit(dataclasses.replace(job(2, 8, stream=False), tier="free"), free)
        refused = free.events[-1] if free.events else None
        paid = Client()
        await trio.sleep(4.0)  # the replica the refused request asked for is half started
        pool.submit(job(3, 8, stream=False), paid)
        await paid.done.wait()
    assert empty == (0, ())
    assert isinstance(first.events[-1], Finished) and START <= waited <= START + 1.0
    assert measured == pytest.approx(START, abs=0.3)
    assert stopped == (0, "down 1 -> 0 (idle): no work for 30s")
    assert isinstance(refused, Failed) and isinstance(refused.error, Starting) and refused.retryable
    assert refused.error.retry_after == pytest.approx(START, abs=0.3)
    assert isinstance(paid.events[-1], Finished) and paid.ended - arrived <= START + 1.0


async def test_a_warm_replica_takes_the_first_request_within_a_tick_and_the_warm_pool_refills(autojump_clock):
    config = model(warm_workers=1)
    spawn = SimulatedEngines(EngineSpec.of(config), start_s=START)
    async with open_continuous(config, QUEUE, spawn, ByteTokenizer()) as pool:
        await trio.sleep(START + 2 * TICK)
        before = pool.fleet()
        states = [w.state for w in pool.snapshot().status.workers]
        first, arrived = Client(), trio.current_time()
        pool.submit(job(1, 400, stream=True), first)  # long enough for the scaler to see it run
        await first.done.wait()
        after = pool.fleet()
    assert (before.serving, before.warm) == (0, 1) and states == ["warm"]
    assert isinstance(first.events[-1], Finished) and first.times[1] - arrived < 2 * TICK  # no start
    assert (after.serving, after.warm + after.warming) == (1, 1) and len(spawn.spawned) == 2
