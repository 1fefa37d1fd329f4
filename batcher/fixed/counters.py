"""The fixed mode's counters: batches, calls, retries and bisections on top of the shared ones."""

from __future__ import annotations

import collections
import dataclasses

from batcher.core.counters import Counters, Histogram

BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 50, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(slots=True)
class BatchCounters(Counters):
    """The fixed mode's counters: batches, calls, retries and bisections on top of the shared ones."""

    flushes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    flushed_requests: int = 0  # sum of the sizes of new batches (retries not counted again)
    calls: int = 0  # run_batch calls sent to workers, retries and probes included
    probes: int = 0  # calls of one empty input, sent to prove a fleet that lost every worker serves again
    busy_seconds: float = 0.0  # summed over workers: time spent inside calls
    retries: int = 0  # batches re-dispatched whole after a failed call
    bisections: int = 0  # batches split in two to isolate a failing input
    failed_inputs: int = 0  # requests failed because their input failed alone
    batch_sizes: Histogram = dataclasses.field(default_factory=lambda: Histogram(BATCH_SIZE_BOUNDS))

    @property
    def mean_batch(self) -> float:
        """Mean size of the batches flushed from the queues."""
        flushes = sum(self.flushes.values())
        return self.flushed_requests / flushes if flushes else 0.0
