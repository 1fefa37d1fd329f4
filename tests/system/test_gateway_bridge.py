"""The asyncio <-> trio bridge, in one process: the real batcher and pool on the trio thread,
simulated workers (real clock, a few ms a call) behind them, an asyncio loop in front.

These tests are synchronous functions that run their own ``asyncio.run``: pytest-trio owns
async tests here, and the point is the asyncio side."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from batcher.core.backend import Delta, Failed, Finished, Job, Sampling, Started
from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import Overloaded
from batcher.fixed.batcher import open_batcher
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.policy import SizeOrTimeout
from batcher.sim.fixed.workers import SimulatedWorker, constant
from gateway.bridge import Bridge, CoreStopped
from tests.support.waiting import until_asyncio

M = FixedModelConfig(name="m", worker=("echo",))


class Core:
    """A ``launch`` for the bridge: model ``m`` (or any other) on simulated workers."""

    def __init__(self, max_batch: int = 50, max_wait: float = 0.005, workers: int = 2) -> None:
        self.policy = SizeOrTimeout(max_batch, max_wait)
        self.workers = workers
        self.spawned: list[SimulatedWorker] = []

    def spawn(self, slot: int) -> SimulatedWorker:
        worker = SimulatedWorker(constant(0.005))
        self.spawned.append(worker)
        return worker

    def __call__(self, model, queue):
        return open_batcher(self.spawn, PoolConfig(workers=self.workers), self.policy, queue)

    def inputs_seen(self) -> list[str]:
        return [text for worker in self.spawned for call in worker.calls for text in call]


def job(text: str, tier: str | None = "paid", deadline: float | None = None) -> Job:
    return Job(text, text.encode(), Sampling(100), tier, deadline=deadline)


async def until_ended(handle) -> list:
    """Every event of one job, in order, once it has ended."""
    events = []
    while not handle.ended or handle.events:
        events += await handle.wait()
    return events


def run(core, body):
    """Start a bridge over ``core``, run ``await body(bridge)``, stop the bridge; body's result."""

    async def main():
        bridge = Bridge(core, [M], QueueConfig())
        await bridge.start()
        try:
            return await body(bridge)
        finally:
            await bridge.stop()

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_burst_crosses_in_one_hop_each_way_per_batch():
    core = Core(max_batch=50)

    async def burst(bridge):
        handles = [bridge.submit("m", job(f"r{i}")) for i in range(100)]
        return bridge, await asyncio.gather(*(until_ended(h) for h in handles))

    bridge, done = run(core, burst)
    assert [[type(e) for e in events] for events in done] == [[Started, Delta, Finished]] * 100
    assert [events[1].text for events in done] == [f"r{i}"[::-1] for i in range(100)]
    assert bridge.hops_to_trio == 1  # 100 submits from one loop iteration: one hop
    assert bridge.hops_to_asyncio <= 2  # two batches of 50, finishing together or apart


def test_a_cancelled_handle_leaves_the_queue_before_any_worker_sees_it():
    core = Core(max_batch=50, max_wait=60.0)

    async def leave(bridge):
        async def queued() -> int:
            return (await bridge.snapshots())["m"].status.queued

        async def taken_back():
            snapshot = (await bridge.snapshots())["m"]
            return snapshot if snapshot.counters.cancelled else None

        handle = bridge.submit("m", job("never"))
        await until_asyncio(queued, "the job queued in the core", every=0.001)
        bridge.cancel(handle)
        snapshot = await until_asyncio(taken_back, "the core to take the job back", every=0.001)
        # A job the core refuses at once, submitted after the cancel: every event emitted before
        # its end (any the left job got) has crossed with it, so nothing more can arrive.
        await until_ended(bridge.submit("m", job("after", "no-such-tier")))
        return handle, snapshot.status.queued, snapshot.counters.calls

    handle, queued, calls = run(core, leave)
    assert handle.left and handle.events == []
    assert (queued, calls) == (0, 0)
    assert core.inputs_seen() == []


def test_a_request_past_its_deadline_comes_back_failed_with_overloaded():
    core = Core(max_batch=50, max_wait=60.0)

    async def late(bridge):
        return await until_ended(bridge.submit("m", job("late", "free", deadline=0.01)))

    [failed] = run(core, late)
    assert isinstance(failed, Failed) and isinstance(failed.error, Overloaded) and failed.retryable


def test_an_unknown_tier_fails_that_request_alone():
    async def mixed(bridge):
        bad = bridge.submit("m", job("x", "gold"))
        good = bridge.submit("m", job("y"))
        return await until_ended(bad), await until_ended(good)

    [failed], good = run(Core(), mixed)
    assert isinstance(failed.error, CoreStopped) and "tier: expected one of" in str(failed.error)
    assert good[1].text == "y"


def test_after_stop_nothing_is_accepted_and_a_failed_start_raises():
    async def main():
        bridge = Bridge(Core(), [M], QueueConfig())
        await bridge.start()
        assert bridge.running
        await bridge.stop()
        assert not bridge.running
        with pytest.raises(CoreStopped):
            bridge.submit("m", job("x"))

        @contextlib.asynccontextmanager
        async def broken(model, queue):
            raise OSError("no GPU")
            yield

        with pytest.RaisesGroup(pytest.RaisesGroup(pytest.RaisesExc(OSError, match="no GPU"))):
            await Bridge(broken, [M], QueueConfig()).start()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
