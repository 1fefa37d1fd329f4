"""The scaler's shell over the production batcher and pool of simulated workers, in virtual time
(MockClock): a burst at 3x one worker's capacity grows the fleet to its maximum and back to its
minimum with nothing lost, a busy worker drains before it stops, a warm worker serves within a
tick of the decision that needs it, and a version at ``min_workers = 0`` starts a worker for
the first request and stops it after ``idle_after_s``; at zero again, a request whose wait budget
is shorter than the measured start is refused (503) with the time to ready as its Retry-After.

A simulated worker answers a call of up to 4 requests in 0.2 s: 20 requests/s each."""

from __future__ import annotations

import contextlib

import trio

from batcher.core.config import QueueConfig
from batcher.core.errors import Starting
from batcher.core.scaling import TICK
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.mode import open_fixed
from batcher.fixed.request import RequestState
from batcher.fixed.slot import SlotState
from gateway.text.tokenizer import ByteTokenizer
from tests.support.fixed_batcher import Outcomes
from tests.support.spawner import Spawner
from tests.support.waiting import until_trio

BUDGETS = QueueConfig(wait_budgets=(1.0, 0.3))


@contextlib.asynccontextmanager
async def elastic(fleet: Spawner, **keys):
    keys = {"workers": 1, "max_batch": 4, "max_wait_ms": 50, "scale_down_after_s": 5.0} | keys
    model = FixedModelConfig(name="m@1", worker=["sleep"], **keys)
    async with open_fixed(model, BUDGETS, fleet, ByteTokenizer()) as batcher:
        yield batcher


async def offer(outcomes: Outcomes, rate: float, seconds: float, sizes: list[int] | None = None) -> None:
    """Paid requests at ``rate`` a second for ``seconds``; the fleet's serving size after each."""
    for index in range(round(rate * seconds)):
        outcomes.add([f"r{index}"], "paid")
        if sizes is not None:
            sizes.append(outcomes.batcher.pool.fleet().serving)
        await trio.sleep(1 / rate)


async def test_a_burst_at_three_times_one_workers_capacity_grows_to_max_and_shrinks_back_losing_nothing(
        autojump_clock):
    fleet = Spawner()
    async with elastic(fleet, min_workers=1, max_workers=4) as batcher:
        outcomes, sizes = Outcomes(batcher), []
        await offer(outcomes, rate=60.0, seconds=20.0, sizes=sizes)
        await outcomes.wait(1200)
        during = batcher.pool.fleet().serving
        await trio.sleep(6.0)  # virtual time: scale_down_after_s of spare capacity, and the rate's decay
        after = batcher.pool.fleet().serving
        workers = batcher.pool.workers()
        events = dict(batcher.counters.scale_events)
        stopped = sum(w.stopped for _, w in fleet.spawned)
    assert max(sizes) == during == 4 and after == 1 and len(workers) == 1
    assert [r.state for r in outcomes.ended].count(RequestState.DONE) == 1200  # no request lost or shed
    assert events[("down", "spare")] == 1 and sum(n for (way, _), n in events.items() if way == "up") >= 1
    assert len(fleet.spawned) == 4 and stopped == 3


async def test_a_busy_worker_leaving_finishes_its_call_before_it_stops(autojump_clock):
    fleet = Spawner(service=2.0)
    async with elastic(fleet, workers=2, max_batch=1, max_wait_ms=0, hang_timeout_ms=5000) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(["a", "b"], "paid")
        await trio.sleep(0.5)  # virtual time: both workers are in their calls
        batcher.pool.retire(1)
        draining = [w.state for w in batcher.pool.workers()]
        stopped_in_call = fleet.worker(1).stopped
        await outcomes.wait(2)
        await trio.sleep(TICK)
        after = [w.slot for w in batcher.pool.workers()]
    assert draining == [SlotState.BUSY, SlotState.DRAINING] and not stopped_in_call
    assert [r.result() for r in requests] == ["a", "b"]
    assert after == [0] and fleet.worker(1).stopped and len(fleet.spawned) == 2


async def test_a_warm_worker_serves_within_a_tick_of_the_decision_and_the_warm_pool_refills(autojump_clock):
    fleet = Spawner()
    async with elastic(fleet, min_workers=1, max_workers=2, warm_workers=1) as batcher:
        await trio.sleep(2 * TICK)
        before = batcher.pool.fleet()
        warm_slot = [w.slot for w in batcher.pool.workers() if w.state is SlotState.WARM]
        outcomes = Outcomes(batcher)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(offer, outcomes, 40.0, 3.0)
            await until_trio(lambda: batcher.counters.scale_events, "a decision to scale up", every=0.001)
            decided = trio.current_time()
            await until_trio(lambda: fleet.calls(warm_slot[0]), "the warm worker's first call", every=0.001)
            served = trio.current_time() - decided
        await trio.sleep(2 * TICK)
        after = batcher.pool.fleet()
    assert (before.serving, before.warm) == (1, 1) and warm_slot == [1]
    assert served <= TICK  # its first batch, with no start in between
    assert (after.serving, after.warm) == (2, 1) and len(fleet.spawned) == 3


async def test_a_warm_worker_that_dies_is_replaced(autojump_clock):
    fleet = Spawner()
    async with elastic(fleet, min_workers=1, max_workers=1, warm_workers=1) as batcher:
        await trio.sleep(2 * TICK)
        fleet.worker(1).kill()
        await trio.sleep(1.0)
        warm = batcher.pool.fleet().warm
    assert warm == 1 and len(fleet.spawned) == 3


async def test_at_min_zero_the_first_request_starts_a_worker_which_stops_after_idle_after(autojump_clock):
    fleet = Spawner()
    async with elastic(fleet, min_workers=0, max_workers=2, idle_after_s=30.0) as batcher:
        await trio.sleep(10.0)
        empty = len(fleet.spawned)
        ready_at_zero = batcher.snapshot().status.ready
        answer = await batcher.answer("first", "paid")
        started = batcher.pool.fleet().serving
        await trio.sleep(29.0)
        kept = batcher.pool.fleet().serving
        await trio.sleep(2.0)
        stopped = batcher.pool.fleet().serving, batcher.snapshot().status.scaling
    assert (empty, ready_at_zero, answer, started, kept) == (0, True, "tsrif", 1, 1)
    assert stopped[0] == 0 and stopped[1] == "down 1 -> 0 (idle): no work for 30s"


async def test_at_zero_a_budget_shorter_than_the_measured_start_is_refused_with_the_time_to_ready(
        autojump_clock):
    fleet = Spawner(start_s=5.0)
    async with elastic(fleet, min_workers=0, max_workers=1, idle_after_s=1.0) as batcher:
        first = await batcher.answer("first", "paid", timeout=30.0)  # no start measured yet: it waits
        measured = batcher.snapshot().status.details["start_seconds"]
        await trio.sleep(3.0)  # virtual time: idle_after_s, and the worker stops
        stopped = batcher.pool.fleet().serving
        outcomes = Outcomes(batcher)
        refused = outcomes.add(["short"], "free")[0]  # a 0.3 s budget: shorter than the start
        await trio.sleep(2 * TICK)
        starting = batcher.pool.fleet().starting
        patient = outcomes.add(["long"], "paid", timeout=30.0)[0]  # the rest of the start fits
        await outcomes.wait(2)
    assert (first, measured, stopped, starting) == ("tsrif", 5.0, 0, 1)
    assert isinstance(refused.error, Starting) and refused.error.retry_after == 5.0
    assert patient.result() == "gnol"
