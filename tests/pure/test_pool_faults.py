"""The pool under fleet-wide faults, in virtual time (MockClock): workers dying while idle,
calls lost to workers already gone, fleets that crash or hang on every call, slow fleets.

Times are exact virtual times: 0.2 s service, T = 0.15 s, hang_timeout 1 s, restart backoff
0.1 s doubling while restarted workers serve nothing. Each ``trio.sleep`` moves that clock to an
instant the scenario names; none waits for something to happen.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import RequestFailed, WorkersFailed
from batcher.fixed.batcher import open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.request import RequestState
from tests.support.fixed_batcher import HANG, SERVICE, Outcomes, T, running, texts
from tests.support.spawner import Spawner
from workers.faults import FaultPlan


async def test_workers_killed_while_idle_are_noticed_and_replaced_without_traffic(autojump_clock):
    fleet = Spawner()
    async with running(fleet, workers=8) as batcher:
        await trio.sleep(1.0)  # virtual time: an idle second
        for slot in range(8):
            fleet.worker(slot).kill()
        await trio.sleep(0.05)  # virtual time: t=1.05, inside the restart backoff
        noticed = batcher.pool.live_workers, [info.restarts for info in batcher.pool.workers()]
        await trio.sleep(0.1)  # virtual time: the restart backoff
        replaced = batcher.pool.live_workers, [info.restarts for info in batcher.pool.workers()]
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 50))
        await outcomes.wait(50)
    assert noticed == (0, [1] * 8)  # at t=1.05, before any request arrived
    assert replaced == (8, [1] * 8)
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 50)]
    # the fleet's one probe (every slot had lost its worker) went to whichever replacement came
    # up first, in trio's scheduling order; the batch went whole to the lowest slot left idle
    probed = [slot for slot in range(8) if [""] in fleet.calls(slot)]
    assert [call for call in fleet.calls() if call == [""]] == [[""]] and len(fleet.spawned) == 16
    lowest_idle = min(set(range(8)) - set(probed))
    assert [call for call in fleet.calls() if call != [""]] == fleet.calls(lowest_idle) == [texts("r", 50)]


async def test_a_batch_sent_to_a_worker_already_gone_costs_it_no_attempt(autojump_clock):
    # Slot 1 crashes on B, whose retry waits for slot 0 (busy with A). Slot 0's worker is
    # killed the moment it answers A, so B is handed to it and finds it gone: B must not count
    # that as its second failure (which would bisect it) but wait for the next live worker.
    fleet = Spawner(plans={1: FaultPlan(crash_on_call=1)})
    async with running(fleet) as batcher:
        first = fleet.worker(0)
        batcher.pool.on_answer = lambda size, seconds: first.kill()
        outcomes = Outcomes(batcher)
        a = outcomes.add(texts("a", 50))
        await trio.sleep(0.05)  # virtual time: B arrives at t=0.05, while A runs
        b = outcomes.add(texts("b", 50))
        await outcomes.wait(100)
    assert [r.finished_at for r in a] == [pytest.approx(SERVICE)] * 50
    # B crashed slot 1 at 0.15; slot 1's replacement (up at 0.25) serves it whole
    assert [r.finished_at for r in b] == [pytest.approx(0.25 + SERVICE)] * 50
    assert [r.result() for r in b] == [t[::-1] for t in texts("b", 50)]
    assert (batcher.counters.retries, batcher.counters.bisections, batcher.counters.calls) == (1, 0, 3)
    assert first.calls == [texts("a", 50)]  # the gone worker received nothing more


BUDGETS = QueueConfig(wait_budgets=(1.0, 0.3))  # paid, free: the embedded default's


@contextlib.asynccontextmanager
async def forty_on_one_worker(fleet: Spawner):
    """One worker with the default's budgets; 20 paid and 20 free requests queued at t=0.
    Yields the batcher, the outcomes and the paid and free requests."""
    pool = PoolConfig(workers=1, hang_timeout=HANG)
    async with open_batcher(fleet, pool, SizeOrTimeout(50, T), BUDGETS) as batcher:
        outcomes = Outcomes(batcher)
        yield (
            batcher,
            outcomes,
            outcomes.add(texts("paid", 20), "paid"),
            outcomes.add(texts("free", 20), "free"),
        )


async def test_a_fleet_that_crashes_on_every_call_fails_each_request_by_its_budget_plus_one_hang_timeout(
    autojump_clock,
):
    fleet = Spawner(every=FaultPlan(crash_on_call=1))
    async with forty_on_one_worker(fleet) as (batcher, outcomes, paid, free):
        await trio.sleep(0.2)  # virtual time: t=0.2
        before = batcher.pool.ready  # the batch has gone out at 0.15; it crashes its worker at 0.25
        await trio.sleep(0.2)  # virtual time: t=0.4
        during = batcher.pool.ready, batcher.pool.live_workers  # the replacement (up at 0.35) crashes too
        await outcomes.wait(40)
        fleet.every = None  # the fix is deployed: the next worker, up at 2.05, is healthy
        await trio.sleep(0.1)  # virtual time: 0.1 s later
        fixed = batcher.pool.ready, batcher.pool.live_workers
        assert await batcher.answer("after", "paid") == "retfa"
        served = batcher.pool.ready
    # retried, bisected, restarted with a growing backoff (0.1, 0.2, 0.4, 0.8 s), and given up
    # on at the deadline + 1 s: in the backlog or in a call, wherever each request then was
    assert [r.finished_at for r in paid] == [pytest.approx(1.0 + HANG)] * 20
    assert [r.finished_at for r in free] == [pytest.approx(0.3 + HANG)] * 20
    assert {str(r.error) for r in paid} == {
        "no worker could serve it by its deadline (2.000s after arrival); last: a worker crashed"
    }
    assert all(isinstance(r.error, WorkersFailed) for r in paid + free)
    assert (batcher.counters.timed_out, batcher.counters.restarts) == (40, 4)
    # not ready from the first crash until a worker serves again, though one is up in between
    assert (before, during, fixed, served) == (True, (False, 1), (False, 1), True)


async def test_a_fleet_that_hangs_on_every_call_fails_each_request_while_its_retry_still_runs(autojump_clock):
    hanging = Spawner(every=FaultPlan(hang_on_call=1))
    async with forty_on_one_worker(hanging) as (batcher, outcomes, paid, free):
        await outcomes.wait(40)
        running_then = batcher.pool.busy_count, batcher.pool.ready
    # hung at 0.15 + 1 s, killed; the retry on the replacement (sent at 1.25) hangs too
    assert [r.finished_at for r in free] == [pytest.approx(0.3 + HANG)] * 20
    assert [r.finished_at for r in paid] == [pytest.approx(1.0 + HANG)] * 20
    assert {str(r.error) for r in free} == {
        "no worker could serve it by its deadline (1.300s after arrival); last: a worker hung"
    }
    assert running_then == (1, False)


async def test_a_fleet_slower_than_hang_timeout_loses_one_worker_then_serves_at_its_own_pace(autojump_clock):
    fleet = Spawner(every=FaultPlan(slow_factor=5.5))  # every call takes 1.1 s against a 1 s hang_timeout
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        first = outcomes.add(texts("a", 50))
        await outcomes.wait(50)
        await trio.sleep_until(3.0)
        second = outcomes.add(texts("b", 50))
        await outcomes.wait(100)
    # worker 0 is killed as hung at 1.0; the retry may take 2 s on worker 1 and is answered at
    # 2.1; then a call may take 3 x 1.1 s, and worker 0's replacement answers the next in 1.1 s
    assert [r.finished_at for r in first] == [pytest.approx(1.0 + 1.1)] * 50
    assert [r.finished_at for r in second] == [pytest.approx(3.0 + 1.1)] * 50
    assert [r.result() for r in second] == [t[::-1] for t in texts("b", 50)]
    assert (batcher.counters.restarts, batcher.pool.call_seconds) == (1, pytest.approx(1.1))
    assert fleet.calls(0)[-1] == texts("b", 50)


async def test_a_hang_among_slowed_calls_is_detected_at_three_recent_call_times(autojump_clock):
    slow = FaultPlan(slow_factor=2.0)  # 0.4 s calls: under hang_timeout, so nothing is killed...
    fleet = Spawner(plans={0: FaultPlan(slow_factor=2.0, hang_on_call=3)}, every=slow)
    async with running(fleet, workers=1) as batcher:
        outcomes = Outcomes(batcher)
        for start in (0.0, 0.5, 1.0):
            await trio.sleep_until(start)
            batch = outcomes.add(texts(f"{start}-", 50))
        await outcomes.wait(150)
    # ...but the calls are now judged against 3 x 0.4 s: the third call, sent at 1.0, is hung at
    # 2.2 (not 2.0); the replacement is up at 2.3 and answers its retry at 2.7
    assert [r.finished_at for r in batch] == [pytest.approx(1.0 + 1.2 + 0.1 + 0.4)] * 50
    assert batcher.counters.restarts == 1


async def test_a_poisoned_batch_under_tier_budgets_still_serves_its_batch_mates(autojump_clock):
    """The answer deadline bounds time lost to workers (crashes, hangs), not the isolation of a
    bad input: live workers answered with the model's error, so bisection runs its course,
    bounded in calls, though it outlasts the free tier's 0.3 s budget + one hang timeout."""
    poison = FaultPlan(poison="☠")
    queue = QueueConfig(tiers=("paid", "free"), wait_budgets=(1.0, 0.3))
    pool = PoolConfig(workers=2, hang_timeout=HANG)
    async with open_batcher(Spawner(every=poison), pool, SizeOrTimeout(50, T), queue) as batcher:
        outcomes = Outcomes(batcher)
        inputs = texts("r", 50)
        inputs[37] = "r37 ☠"
        requests = outcomes.add(inputs, tier="free")
        await outcomes.wait(50)
    failed = [r for r in requests if r.state is RequestState.FAILED]
    assert [r.input for r in failed] == ["r37 ☠"] and isinstance(failed[0].error, RequestFailed)
    assert [r.result() for r in requests if r is not failed[0]] == [t[::-1] for t in inputs if "☠" not in t]
    assert max(r.finished_at for r in requests) > 0.3 + HANG  # past the deadline a worker fault would have
    assert batcher.counters.timed_out == 0


async def test_a_fleet_that_lost_every_worker_proves_itself_with_a_probe_call_without_traffic(autojump_clock):
    fleet = Spawner()
    async with running(fleet, workers=2) as batcher:
        await trio.sleep(1.0)  # virtual time: an idle second
        for slot in range(2):
            fleet.worker(slot).kill()
        await trio.sleep(0.2)  # virtual time: the restart backoff (0.1 s), then the probe call is on its way
        during = batcher.pool.ready, batcher.counters.probes
        await trio.sleep(0.2)  # virtual time: one call later
        after = batcher.pool.ready, batcher.counters.probes, batcher.counters.flushed_requests
    assert during == (False, 1)  # one probe at a time
    assert after == (True, 1, 0)  # ready again, and no request was ever sent
    assert [call for call in fleet.calls() if call == [""]] == [[""]]
