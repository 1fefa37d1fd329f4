"""The fixed mode's side of the scaler: a :class:`~batcher.core.scaling.Elastic` over a batcher
and its pool. Its signals are the ones admission judges by, in requests: the top tier's
predicted wait (``BatchLoad.wait``) against its budget, the requests asked for per second (those
admitted and those refused; or, without wait budgets, flushed), and one worker's speed, a batch
per recent call time. Refused requests count: a fleet that sheds its free tier to keep paid
within budget is short of capacity even while paid's wait is short."""

from __future__ import annotations

import trio

from batcher.core.scaler import Signals
from batcher.core.scaling import Throughput
from batcher.fixed.batcher import Batcher


class FixedFleet:
    """A batcher's pool as the scaler moves it."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.pool = batcher.pool
        self._throughput, self._refused = Throughput(), Throughput()

    def signals(self) -> Signals:
        load, now = self.batcher.load(), trio.current_time()
        per_worker = load.batch / load.call if load.call > 0 else 0.0
        counters = self.batcher.counters
        done = self._throughput.at(now, counters.flushed_requests)
        refused = self._refused.at(now, sum(counters.shed.values()) + counters.expired)
        rate = max(done, sum(load.arrivals) + refused)  # demand: what was asked, not what a full fleet did
        return Signals(load.wait(0), self.batcher.config.deadline(0), rate, per_worker,
                       queued=self.batcher.queue.count + self._cold(), busy=self.pool.busy_count)

    def _cold(self) -> int:
        """1 if a request was refused for want of a worker since the last look: work that starts one."""
        refused, self.pool.staffing.refused = self.pool.staffing.refused, False
        return int(refused)
