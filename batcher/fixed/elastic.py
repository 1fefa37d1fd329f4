"""The fixed mode's side of the scaler: a :class:`~batcher.core.scaling.Elastic` over a batcher
and its pool. Its signals are the ones admission judges by, in requests: the top tier's
predicted wait (``BatchLoad.wait``) against its budget, the requests admitted (or, without wait
budgets, flushed) per second, and one worker's speed, a batch per recent call time."""

from __future__ import annotations

import trio

from batcher.core.scaler import Fleet, Signals
from batcher.core.scaling import Throughput
from batcher.fixed.batcher import Batcher


class FixedFleet:
    """A batcher's pool as the scaler moves it."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.pool = batcher.pool
        self._throughput = Throughput()

    def signals(self) -> Signals:
        load, now = self.batcher.load(), trio.current_time()
        per_worker = load.batch / load.call if load.call > 0 else 0.0
        done = self._throughput.at(now, self.batcher.counters.flushed_requests)
        rate = max(done, sum(load.arrivals))  # a saturated fleet's rate of work is not its demand
        return Signals(load.wait(0), self.batcher.config.deadline(0), rate, per_worker,
                       queued=self.batcher.queue.count, busy=self.pool.busy_count)

    def fleet(self) -> Fleet:
        return self.pool.fleet()

    def start(self, count: int, warm: bool = False) -> None:
        self.pool.start(count, warm)

    def promote(self, count: int) -> None:
        self.pool.promote(count)

    def retire(self, count: int) -> None:
        self.pool.retire(count)

    def report(self, decision: str) -> None:
        self.pool.scaling = decision
