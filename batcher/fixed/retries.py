"""The fixed pool's failed batches: what becomes of a batch whose call failed, and when its
requests fall due. Idle workers take from this backlog before any new batch::

    failed call ──> retry whole (attempt + 1) ──failed on two workers──> bisect into halves
    a half that fails is split again; a single input that failed max_attempts times fails alone

A request of a batch that a worker failed (crashed, hung, broke the protocol) is answered by its
deadline plus one ``hang_timeout``: :meth:`RetryBacklog.fail_overdue` fails it then, whether it
waits here or in a retried call that has not ended. The pool (:mod:`batcher.fixed.pool`) owns
the workers and hands each failure here; this module owns only the backlog."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import trio

from batcher.core.config import PoolConfig
from batcher.core.errors import RequestFailed, WorkersFailed
from batcher.fixed.counters import BatchCounters
from batcher.fixed.request import Batch, Request

Calls = Callable[[], Iterable[tuple[Batch, float]]]
"""The batches in a call now, each with the time its call counts as hung."""


class RetryBacklog:
    """Failed batches waiting for a worker, in the order they are to be retried."""

    def __init__(self, config: PoolConfig, counters: BatchCounters, batch_ids: Iterator[int]) -> None:
        self.config = config
        self.counters = counters
        self._batches: deque[Batch] = deque()
        self._batch_ids = batch_ids  # the pool's: a piece of a bisected batch is a new batch
        self._changed = trio.Event()  # wakes fail_overdue: what it watches, or when, changed

    def __bool__(self) -> bool:
        return bool(self._batches)

    def failed(self, batch: Batch, slot: int, error: str, now: float) -> None:
        """Retry, bisect or give up on a batch whose call failed on worker ``slot``; never lose
        a request. ``error`` is what a caller may be told: what went wrong, not where."""
        batch.failures += 1
        batch.failed_on.add(slot)
        batch.last_error = error
        live = self.drop_overdue(batch, now)
        if not live:
            return
        if len(live) == 1 and batch.failures >= self.config.max_attempts:
            self.counters.failed_inputs += 1
            live[0].fail(RequestFailed(f"the input failed on {batch.failures} attempts; last: {error}"), now)
            return
        if len(live) > 1 and (batch.suspect or batch.failures >= min(2, self.config.max_attempts)):
            self.counters.bisections += 1
            half = len(live) // 2
            for part in (live[:half], live[half:]):
                self._batches.append(Batch(next(self._batch_ids), part, "bisect", suspect=True,
                                           last_error=error, hangs=batch.hangs,
                                           worker_faults=batch.worker_faults))
        else:
            self.counters.retries += 1
            batch.reason = "retry"
            self._batches.append(batch)
        self._changed.set()

    def undelivered(self, batch: Batch) -> None:
        """A batch that never reached its worker goes first, its failures uncounted."""
        self._batches.appendleft(batch)
        self._changed.set()

    def take(self, slot: int, others_up: Callable[[set[int]], bool]) -> Batch | None:
        """The first retry worker ``slot`` may take: one that has not failed on it, or one whose
        failures leave no other worker up (``others_up``) to try it."""
        for position, batch in enumerate(self._batches):
            if slot not in batch.failed_on or not others_up(batch.failed_on):
                del self._batches[position]
                return batch
        return None

    def called(self, batch: Batch, hung_at: float) -> None:
        """``batch`` went into a call that counts as hung at ``hung_at``: if that is after its
        requests fall due, they are watched."""
        if self.due(batch) < hung_at:
            self._changed.set()

    def due(self, batch: Batch) -> float:
        """When the first of a batch's requests must have its answer: its dispatch deadline
        plus one hang timeout (a request dispatched in time, whose call hangs, is failed then).

        Only once a worker has failed the batch (crashed, hung, broke the protocol): a batch
        that live workers answered with the model's error is an input being isolated, and
        bisection bounds that in calls (2 + 2 log2 n + 2), not in time, so its batch mates
        are still served."""
        if not batch.worker_faults:
            return math.inf
        first = min((request.deadline for request in batch.requests), default=math.inf)
        return first + self.config.hang_timeout

    def _watched(self, calls: Calls) -> Iterator[Batch]:
        """The batches whose requests may run out of time before a call of theirs ends: those
        waiting here, and those in a call whose hang timeout falls after their due time."""
        yield from self._batches
        for batch, hung_at in calls():
            if self.due(batch) < hung_at:
                yield batch

    async def fail_overdue(self, calls: Calls) -> None:
        """Fail each watched request when it falls due, with a clear error (WorkersFailed)."""
        while True:
            self._changed = trio.Event()
            with trio.move_on_at(min(map(self.due, self._watched(calls)), default=math.inf)):
                await self._changed.wait()
            now = trio.current_time()
            for batch in list(self._watched(calls)):
                if not self.drop_overdue(batch, now) and batch in self._batches:
                    self._batches.remove(batch)

    def drop_overdue(self, batch: Batch, now: float) -> list[Request]:
        """Fail the batch's requests that are due by ``now``; return the ones still waiting."""
        hang = self.config.hang_timeout if batch.worker_faults else math.inf
        for request in batch.prune():
            if request.deadline + hang <= now:
                self.counters.timed_out += 1
                last = f"last: {batch.last_error}" if batch.last_error else "its call was still running"
                after = request.deadline + hang - request.arrival
                reason = f"no worker could serve it by its deadline ({after:.3f}s after arrival); {last}"
                request.fail(WorkersFailed(reason), now)
        return batch.prune()
