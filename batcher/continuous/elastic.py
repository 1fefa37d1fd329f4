"""The continuous mode's side of the scaler: a :class:`~batcher.core.scaling.Elastic` over an
:class:`~batcher.continuous.pool.EnginePool`. Its signals are in tokens: the top tier's
predicted wait (``TokenLoad.wait``) against its budget, the tokens the engines computed per
second against the fastest replica's measured rate, the prompt tokens queued, the replicas
running sequences, and the share of their KV blocks free; of the ordinary replicas only (a
long-prompt pool is fixed: docs/continuous.md, "A pool for long prompts")."""

from __future__ import annotations

import trio

from batcher.continuous.pool import EnginePool
from batcher.core.scaler import Signals
from batcher.core.scaling import Throughput


class ContinuousFleet:
    """An engine pool as the scaler moves it."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._throughput = Throughput()

    def signals(self) -> Signals:
        """The ordinary replicas' signals: a long-prompt pool is fixed, not the scaler's."""
        pool, now = self.pool, trio.current_time()
        ordinary = [r for r in pool.replicas if not pool.lanes.is_long(r.index)]
        up = [r for r in ordinary if r.up]
        done = sum(r.replica_stats().engine.computed_tokens for r in ordinary)
        total = sum(r.total_blocks for r in up)
        refused, pool.staffing.refused = pool.staffing.refused, False  # work refused for want of a replica
        load = pool.load()
        return Signals(
            load.wait(0), pool.queue_config.deadline(0), self._throughput.at(now, done),
            max((r.computed.value for r in up), default=0.0), queued=sum(load.queued) + refused,
            busy=sum(bool(r.live) for r in up),
            free_kv=sum(r.free_blocks for r in up) / total if total else 1.0,
        )
