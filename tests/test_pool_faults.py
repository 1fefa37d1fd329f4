"""The pool under fleet-wide faults, in virtual time (MockClock): workers dying while idle,
calls lost to workers already gone, fleets that crash or hang on every call, slow fleets.

Times are exact virtual times: 0.2 s service, T = 0.15 s, hang_timeout 1 s, restart backoff
0.1 s doubling while restarted workers serve nothing.
"""

from __future__ import annotations

import pytest
import trio

from batcher.config import PoolConfig, QueueConfig
from batcher.fixed import open_batcher
from batcher.policy import SizeOrTimeout
from tests.conftest import Fleet
from tests.test_batcher import HANG, SERVICE, T, Outcomes, running, texts
from workers.faults import FaultPlan


async def test_workers_killed_while_idle_are_noticed_and_replaced_without_traffic(autojump_clock):
    fleet = Fleet()
    async with running(fleet, workers=8) as batcher:
        await trio.sleep(1.0)
        for slot in range(8):
            fleet.worker(slot).kill()
        await trio.sleep(0.05)
        noticed = batcher.pool.live_workers, [info.restarts for info in batcher.pool.workers()]
        await trio.sleep(0.1)  # the restart backoff
        replaced = batcher.pool.live_workers, [info.restarts for info in batcher.pool.workers()]
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 50))
        await outcomes.wait(50)
    assert noticed == (0, [1] * 8)  # at t=1.05, before any request arrived
    assert replaced == (8, [1] * 8)
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 50)]
    assert fleet.calls(0) == [texts("r", 50)] and len(fleet.spawned) == 16


async def test_a_batch_sent_to_a_worker_already_gone_costs_it_no_attempt(autojump_clock):
    # Slot 1 crashes on B, whose retry waits for slot 0 (busy with A). Slot 0's worker is
    # killed the moment it answers A, so B is handed to it and finds it gone: B must not count
    # that as its second failure (which would bisect it) but wait for the next live worker.
    fleet = Fleet(plans={1: FaultPlan(crash_on_call=1)})
    async with running(fleet) as batcher:
        first = fleet.worker(0)
        batcher.pool.on_answer = lambda size, seconds: first.kill()
        outcomes = Outcomes(batcher)
        a = outcomes.add(texts("a", 50))
        await trio.sleep(0.05)
        b = outcomes.add(texts("b", 50))
        await outcomes.wait(100)
    assert [r.finished_at for r in a] == [pytest.approx(SERVICE)] * 50
    # B crashed slot 1 at 0.15; slot 1's replacement (up at 0.25) serves it whole
    assert [r.finished_at for r in b] == [pytest.approx(0.25 + SERVICE)] * 50
    assert [r.result() for r in b] == [t[::-1] for t in texts("b", 50)]
    assert (batcher.stats.retries, batcher.stats.bisections, batcher.stats.calls) == (1, 0, 3)
    assert first.calls == [texts("a", 50)]  # the gone worker received nothing more
