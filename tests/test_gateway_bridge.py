"""The asyncio <-> trio bridge, in one process: the real batcher and pool on the trio thread,
simulated workers (real clock, a few ms a call) behind them, an asyncio loop in front.

These tests are synchronous functions that run their own ``asyncio.run``: pytest-trio owns
async tests here, and the point is the asyncio side."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from batcher.config import PoolConfig, QueueConfig
from batcher.fixed import open_batcher
from batcher.policy import SizeOrTimeout
from batcher.types import Overloaded, State
from gateway.bridge import Bridge, CoreStopped
from workers.simulated import SimulatedWorker, constant


class Core:
    """An ``open_core`` for the bridge: one model, ``m``, on simulated workers."""

    def __init__(self, max_batch: int = 50, max_wait: float = 0.005, workers: int = 2) -> None:
        self.policy = SizeOrTimeout(max_batch, max_wait)
        self.workers = workers
        self.spawned: list[SimulatedWorker] = []

    def spawn(self, slot: int) -> SimulatedWorker:
        worker = SimulatedWorker(constant(0.005))
        self.spawned.append(worker)
        return worker

    @contextlib.asynccontextmanager
    async def __call__(self):
        pool = PoolConfig(workers=self.workers)
        async with open_batcher(self.spawn, pool, self.policy, QueueConfig()) as batcher:
            yield {"m": batcher}

    def inputs_seen(self) -> list[str]:
        return [text for worker in self.spawned for call in worker.calls for text in call]


def run(core, body):
    """Start a bridge over ``core``, run ``await body(bridge)``, stop the bridge; body's result."""

    async def main():
        bridge = Bridge(core)
        await bridge.start()
        try:
            return await body(bridge)
        finally:
            await bridge.stop()

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_burst_crosses_in_one_hop_each_way_per_batch():
    core = Core(max_batch=50)

    async def burst(bridge):
        handles = [bridge.submit("m", f"r{i}", "paid") for i in range(100)]
        return bridge, await asyncio.gather(*(h.future for h in handles))

    bridge, done = run(core, burst)
    assert [request.output for request in done] == [f"r{i}"[::-1] for i in range(100)]
    assert all(request.state is State.DONE for request in done)
    assert bridge.hops_to_trio == 1  # 100 submits from one loop iteration: one hop
    assert bridge.hops_to_asyncio <= 2  # two batches of 50, finishing together or apart


def test_a_cancelled_handle_leaves_the_queue_before_any_worker_sees_it():
    core = Core(max_batch=50, max_wait=60.0)

    async def leave(bridge):
        handle = bridge.submit("m", "never", "paid")
        batcher = bridge.batcher("m")
        while batcher.queue.count == 0:
            await asyncio.sleep(0.001)
        bridge.cancel(handle)
        while batcher.stats.cancelled == 0:
            await asyncio.sleep(0.001)
        return handle, batcher.queue.count, batcher.stats.calls

    handle, queued, calls = run(core, leave)
    assert handle.future.cancelled()
    assert (queued, calls) == (0, 0)
    assert core.inputs_seen() == []


def test_a_request_past_its_deadline_comes_back_failed_with_overloaded():
    core = Core(max_batch=50, max_wait=60.0)

    async def late(bridge):
        return await bridge.submit("m", "late", "free", timeout=0.01).future

    request = run(core, late)
    assert request.state is State.FAILED and isinstance(request.error, Overloaded)


def test_an_unknown_tier_fails_that_request_alone():
    async def mixed(bridge):
        bad = bridge.submit("m", "x", "gold")
        good = bridge.submit("m", "y", "paid")
        with pytest.raises(CoreStopped, match="tier: expected one of"):
            await bad.future
        return (await good.future).output

    assert run(Core(), mixed) == "y"


def test_after_stop_nothing_is_accepted_and_a_failed_start_raises():
    async def main():
        bridge = Bridge(Core())
        await bridge.start()
        assert bridge.running
        await bridge.stop()
        assert not bridge.running
        with pytest.raises(CoreStopped):
            bridge.submit("m", "x", "paid")

        @contextlib.asynccontextmanager
        async def broken():
            raise OSError("no GPU")
            yield {}

        with pytest.RaisesGroup(pytest.RaisesExc(OSError, match="no GPU")):
            await Bridge(broken).start()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
