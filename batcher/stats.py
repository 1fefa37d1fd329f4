"""Counters the batcher and the pool keep as they work: plain numbers, cheap to bump.

Experiments print them, tests assert on them, and the metrics registry exports them.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(slots=True)
class Stats:
    flushes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    flushed_requests: int = 0  # sum of the sizes of new batches (retries not counted again)
    expired: int = 0  # queued past their deadline: Overloaded
    cancelled: int = 0  # callers gone, before or after dispatch
    calls: int = 0  # run_batch calls sent to workers, retries included
    busy_seconds: float = 0.0  # summed over workers: time spent inside calls
    restarts: int = 0  # workers killed (crash, hang, protocol fault) and started again
    retries: int = 0  # batches re-dispatched whole after a failed call
    bisections: int = 0  # batches split in two to isolate a failing input
    failed_inputs: int = 0  # requests failed because their input failed alone

    @property
    def mean_batch(self) -> float:
        """Mean size of the batches flushed from the queues."""
        flushes = sum(self.flushes.values())
        return self.flushed_requests / flushes if flushes else 0.0
