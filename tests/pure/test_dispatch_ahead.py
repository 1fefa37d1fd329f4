"""Dispatch ahead (``PoolConfig.dispatch_ahead``) in virtual time (MockClock): a busy worker near
its call's end takes the next batch into its pipe, and the contract still holds.

Times are exact virtual times: 0.2 s service, batches of 50 or after T = 0.15 s, 20 ms ahead.
A worker learns the call time from its first answer, so the third batch on one worker is the
first that can be framed ahead: at 0.4 - 0.02 = 0.38 s.
"""

from __future__ import annotations

import contextlib

import pytest
import trio
import trio.testing

from batcher.core.config import PoolConfig, QueueConfig
from batcher.fixed.batcher import open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.sim.arrivals import Trace, poisson
from batcher.sim.fixed.simulate import Scenario, simulate
from batcher.sim.fixed.workers import SimulatedWorker, constant
from tests.support.fixed_batcher import HANG, SERVICE, Outcomes, T, texts
from tests.support.spawner import Spawner
from workers.protocol import RunBatch

AHEAD = 0.02


@contextlib.asynccontextmanager
async def ahead(fleet, workers: int = 1):
    pool = PoolConfig(workers=workers, hang_timeout=HANG, dispatch_ahead=AHEAD)
    async with open_batcher(fleet, pool, SizeOrTimeout(50, T), QueueConfig(queue_timeout=30.0)) as batcher:
        yield batcher


async def test_the_next_batch_waits_in_the_pipe_and_calls_still_run_one_at_a_time(autojump_clock):
    fleet = Spawner()
    async with ahead(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 150))
        await outcomes.wait(150)
    a, b, c = requests[:50], requests[50:100], requests[100:]
    assert [r.dispatched_at for r in c] == [pytest.approx(2 * SERVICE - AHEAD)] * 50  # framed ahead
    assert [r.dispatched_at for r in b] == [pytest.approx(SERVICE)] * 50  # no call time known yet
    # one call at a time: each ends a whole service time after the one before it
    for calls, batch in enumerate((a, b, c), start=1):
        assert [r.finished_at for r in batch] == [pytest.approx(calls * SERVICE)] * 50
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 150)]
    assert fleet.calls(0) == [texts("r", 150)[i:i + 50] for i in (0, 50, 100)]


async def test_a_request_cancelled_while_its_batch_waits_in_the_pipe_is_never_run(autojump_clock):
    fleet = Spawner()
    async with ahead(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 150))
        await trio.sleep(2 * SERVICE - AHEAD / 2)  # virtual time: the third batch waits in the pipe
        gone = requests[120]
        batcher.cancel(gone)
        await outcomes.wait(150)
    ran = fleet.calls(0)[2]
    assert len(ran) == 49 and gone.input not in ran
    assert [r.result() for r in requests[100:] if r is not gone] == [t[::-1] for t in ran]


async def test_a_batch_in_a_killed_workers_pipe_goes_to_another_worker_costing_no_attempt(autojump_clock):
    fleet = Spawner()
    async with ahead(fleet, workers=2) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 250))  # A, B at 0; C, D at 0.2; E framed to slot 0 at 0.38
        await trio.sleep(2 * SERVICE - AHEAD / 2)
        killed = fleet.worker(0)
        killed.kill()  # C crashes with it; E, waiting in its pipe, was never delivered
        await outcomes.wait(250)
    c, e = requests[100:150], requests[200:]
    assert killed.calls == [texts("r", 250)[0:50], texts("r", 250)[100:150]]
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 250)]
    assert (batcher.counters.retries, batcher.counters.bisections) == (1, 0)  # C's retry alone
    # slot 1 ends D at 0.4 and takes E first (undelivered goes to the front), then C
    assert [r.finished_at for r in e] == [pytest.approx(3 * SERVICE)] * 50
    assert [r.finished_at for r in c] == [pytest.approx(4 * SERVICE)] * 50


def test_the_simulator_shows_a_turnaround_lost_between_calls_and_dispatch_ahead_winning_it_back():
    """At the fixed-batch scenario's exact capacity (8 workers x 50 / 0.2 s = 2,000/s), 5 ms of
    gateway turnaround a call leaves 1,951/s and the queue grows; framed ahead, it is not paid."""
    base = Scenario(Trace.of(poisson(2000.0, 20.0, 0), {"paid": 0.5, "free": 0.5}, 0, None))
    free = simulate(base).report.latency.p95
    lost = simulate(base.with_(turnaround=0.005)).report.latency.p95
    held = simulate(base.with_(turnaround=0.005, dispatch_ahead=AHEAD)).report.latency.p95
    assert lost > 2 * free
    assert held <= 1.05 * free


def test_a_simulated_worker_pays_the_turnaround_only_for_a_call_sent_after_the_last_ended():
    async def run() -> list[float]:
        worker = SimulatedWorker(constant(SERVICE), turnaround=0.005)
        ends = []
        await worker.send(RunBatch(1, ["a"]))
        await worker.reply(1)
        ends.append(trio.current_time())
        await worker.send(RunBatch(2, ["b"]))  # after call 1 ended: pays the hop
        await worker.send(RunBatch(3, ["c"]))  # ahead, waiting while call 2 runs: does not
        for call in (2, 3):
            await worker.reply(call)
            ends.append(trio.current_time())
        return ends

    ends = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ends == [pytest.approx(0.205), pytest.approx(0.41), pytest.approx(0.61)]


async def test_a_call_whose_every_request_was_cancelled_in_the_pipe_runs_nothing(autojump_clock):
    fleet = Spawner()
    async with ahead(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 150))
        await trio.sleep(2 * SERVICE - AHEAD / 2)  # virtual time: the third batch waits in the pipe
        for request in requests[100:]:
            batcher.cancel(request)
        await outcomes.wait(150)
        later = outcomes.add(texts("s", 50))
        await outcomes.wait(200)
    assert len(fleet.calls(0)) == 3 and fleet.calls(0)[2] == texts("s", 50)  # the empty call ran nothing
    assert batcher.pool.call_seconds == pytest.approx(SERVICE)  # nor counted as a call time
    assert [r.finished_at for r in later] == [pytest.approx(3 * SERVICE)] * 50  # sent at 0.4, at once


async def test_admission_plans_a_queued_request_for_the_moment_a_worker_frames_it_ahead(autojump_clock):
    """A worker takes its next batch ``dispatch_ahead`` before its call ends, so that is when a
    queued request leaves the queue; planning for the call's end instead makes every predicted
    wait, and every 529's Retry-After, ``dispatch_ahead`` too long (a round too long at the edge)."""
    async with ahead(Spawner()) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 200))  # A at 0, B at 0.2, C framed at 0.38, D at 0.58
        paid = batcher.config.tier_index("paid")
        predicted = []
        for at in (0.3, 0.39):  # B running; then B running with C in the pipe
            await trio.sleep_until(at)
            predicted.append(at + batcher.load().dispatch_in(paid))  # when the queue's last is taken
        await outcomes.wait(200)
    last = requests[-1].dispatched_at
    assert last == pytest.approx(3 * SERVICE - AHEAD)
    assert predicted == [pytest.approx(last), pytest.approx(last)]
