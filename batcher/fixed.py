"""The fixed-batch Batcher: collect requests, flush them as batches, hand batches to the pool.

Two ways in, one way out. ``enqueue``/``cancel`` are synchronous calls for code already on the
trio thread (the HTTP bridge, simulations driving millions of requests); ``submit`` is the
awaitable a library user wants. Every outcome leaves through the request's ``on_done``.

The flush loop is a thin shell around two pure objects, the :class:`~batcher.tier_queue.TierQueues`
and the flush policy. It asks the policy what to do, does it, and otherwise sleeps until the
earliest of: the policy's timer, the next request deadline, the queue reaching the policy's size
trigger, or a worker freeing up. It never polls.

A simulation can hand it a :class:`Feed` instead of enqueueing each arrival on time: the loop
admits the arrivals that are due whenever it wakes, and also wakes at the first future arrival
that would have woken it. Every decision sees exactly the requests that have arrived, as with
on-time enqueueing, but virtual time no longer stops at every arrival (the speed of
``batcher.simulate``).

    submit/enqueue ──> TierQueues ──policy says Flush──> WorkerPool.dispatch ──> worker
                          │                                      │
                          └── deadline passed: Overloaded        └── outputs ──> on_done
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import trio

from batcher.admission import AdmissionControl, Load
from batcher.config import PoolConfig, QueueConfig
from batcher.policy import Flush, Policy, QueueState, SizeOrTimeout
from batcher.pool import Spawn, WorkerPool
from batcher.stats import Stats
from batcher.tier_queue import TierQueues
from batcher.types import Overloaded, Request, State


class DeadlineUnreachable(Overloaded):
    """Given up before dispatch: too little time was left to answer before its deadline."""


class Feed(Protocol):
    """Arrivals known in advance (a trace), admitted by the flush loop when they are due."""

    def due(self, now: float) -> list[Request]:
        """The requests that have arrived by ``now`` and were not admitted yet, in arrival order."""

    def next_wake(self, more: int, until: float, drop_before: float) -> float:
        """When the loop must wake for arrivals still to come (inf: not before ``until``).

        That is the arrival that brings ``more`` requests to the queue, or the first arrival
        whose deadline, less ``drop_before``, comes before ``until``.
        """


def _ignore(request: Request) -> None:
    pass


class Batcher:
    def __init__(self, pool: WorkerPool, policy: Policy, queue: QueueConfig) -> None:
        self.pool = pool
        self.policy = policy
        self.config = queue
        self.stats = pool.stats
        self.queue = TierQueues(len(queue.tiers), queue.age_limit, queue.aged_share)
        self._ids = itertools.count(1)
        self._wakeup = trio.Event()
        self._wake_at_count = 1
        self._wake_at_time = math.inf
        self._drop_before: float = getattr(policy, "drop_before", 0.0)
        self._feed: Feed | None = None
        budgets = queue.wait_budgets
        self.admission = AdmissionControl(budgets) if budgets is not None else None
        self._clock = trio.lowlevel.current_clock()  # load() may be read from the metrics thread
        pool.on_idle = self._worker_idle

    def request(
        self,
        input: str,
        tier: str | None = None,
        timeout: float | None = None,
        on_done: Callable[[Request], None] = _ignore,
        arrival: float | None = None,
    ) -> Request:
        """A new request arriving now (or at ``arrival``, for a :class:`Feed` replaying a trace).

        ``tier`` defaults to the lowest; ``timeout`` (seconds after arrival) to the tier's wait
        budget where the config has budgets (the same budget admission judges by), else to its
        ``queue_timeout``.
        """
        now = trio.current_time() if arrival is None else arrival
        index = len(self.config.tiers) - 1 if tier is None else self.config.tier_index(tier)
        wait = timeout if timeout is not None else self.config.deadline(index)
        return Request(next(self._ids), input, index, now, now + wait, on_done)

    def enqueue(self, request: Request) -> None:
        """Queue a request (trio thread, no await); its outcome arrives through ``on_done``.

        With wait budgets configured, a request whose estimated wait exceeds its tier's budget
        is shed at once (:class:`~batcher.types.Overloaded`, with ``retry_after``).
        """
        if not self._admitted(request):
            return
        self.queue.push(request)
        if self.queue.count >= self._wake_at_count or request.deadline - self._drop_before < self._wake_at_time:
            self._wakeup.set()

    def _admitted(self, request: Request) -> bool:
        """Admission by load (DESIGN §8), for enqueued and fed arrivals alike: False if shed."""
        if self.admission is None:
            return True
        verdict = self.admission.judge(self.load(), request.tier, request.arrival)
        if verdict.admitted:
            return True
        self.stats.shed[request.tier] += 1
        message = f"estimated wait {verdict.wait:.3f}s is over the budget of {verdict.budget:.3f}s"
        request.fail(Overloaded(message, verdict.retry_after), request.arrival)
        return False

    def feed(self, feed: Feed) -> None:
        """Admit arrivals from ``feed`` from now on, each when it is due (see the module doc)."""
        self._feed = feed
        self._wakeup.set()

    def cancel(self, request: Request) -> None:
        """The caller has gone: leave the queue at once, or drop the output if already running."""
        if request.done:
            return
        queued = request.state is State.QUEUED
        request.cancel(trio.current_time())
        self.stats.cancelled += 1
        if queued:
            self.queue.discard(request)

    async def submit(self, input: str, tier: str | None = None, timeout: float | None = None) -> str:
        """Run one input through a batch and return its output.

        Raises :class:`~batcher.types.Overloaded` if no worker took it before ``timeout``
        (default: the queue config's), :class:`~batcher.types.RequestFailed` if its input failed
        on every worker that tried it alone. Cancelling the caller takes the request out of the
        queue at once, or drops its output if a worker already has it.
        """
        done = trio.Event()
        request = self.request(input, tier, timeout, on_done=lambda _: done.set())
        self.enqueue(request)
        try:
            await done.wait()
        finally:
            self.cancel(request)
        return request.result()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The flush loop: runs until cancelled."""
        task_status.started()
        queue, pool, policy, drop_before = self.queue, self.pool, self.policy, self._drop_before
        while True:
            now = trio.current_time()
            if self._feed is not None:
                for request in self._feed.due(now):
                    if self._admitted(request):
                        queue.push(request)
            if queue.count:
                self._expire(now)
            deadline = queue.next_deadline()
            decision = policy.decide(QueueState(now, queue.count, queue.oldest_arrival(), pool.idle_count, deadline))
            if isinstance(decision, Flush):
                batch = queue.take(decision.size, now)
                self.stats.flushes[decision.reason] += 1
                self.stats.flushed_requests += len(batch)
                pool.dispatch(batch, decision.reason, now)
                continue
            self._wake_at_count = decision.queued
            self._wake_at_time = wake = min(decision.until, _drop_time(deadline, drop_before))
            if self._feed is not None:
                more = 1 if self.admission is not None else decision.queued - queue.count  # judged on time
                wake = min(wake, self._feed.next_wake(more, wake, drop_before))
            self._wakeup = trio.Event()
            with trio.move_on_at(wake):
                await self._wakeup.wait()

    def load(self) -> Load:
        """Queued requests per tier and when each live worker takes its next batch (DESIGN §8).

        A batch is the policy's size limit; a call lasts the recent call time (0 until one has
        been answered). Safe to read from the metrics thread: it only reads.
        """
        now = self._clock.current_time()
        queued = tuple(self.queue.queued(tier) for tier in range(len(self.config.tiers)))
        batch = getattr(self.policy, "limit", None) or getattr(self.policy, "max_batch", 1)
        arrivals = self.admission.arrivals(now) if self.admission is not None else ()
        return Load(queued, tuple(self.pool.free_in(now)), batch, self.pool.call_seconds, arrivals)

    def _retry_after(self, load: Load, tier: int, now: float) -> float:
        """When the queue ahead of a request of ``tier`` should have drained (its 529's Retry-After)."""
        if self.admission is not None:
            return self.admission.retry_after(load, tier, now)
        return max(load.dispatch_in(tier), 1.0 / load.drain_rate if load.drain_rate else 1.0)

    def _expire(self, now: float) -> None:
        """Fail the queued requests past their deadline, or too near it for the policy."""
        expired = self.queue.expire(now + self._drop_before)
        load = self.load() if expired else None
        for request in expired:
            self.stats.expired += 1
            waited = now - request.arrival
            retry_after = self._retry_after(load, request.tier, now)
            if self._drop_before:
                left = request.deadline - now
                message = f"{left:.3f}s left before its deadline after {waited:.3f}s"
                error: Overloaded = DeadlineUnreachable(message, retry_after)
            else:
                error = Overloaded(f"not dispatched within {waited:.3f}s of arrival", retry_after)
            request.fail(error, now)

    def _worker_idle(self) -> None:
        if self.queue.count or self._feed is not None:
            self._wakeup.set()


@contextlib.asynccontextmanager
async def open_batcher(
    spawn: Spawn,
    pool: PoolConfig = PoolConfig(),
    policy: Policy = SizeOrTimeout(),
    queue: QueueConfig = QueueConfig(),
    stats: Stats | None = None,
) -> AsyncIterator[Batcher]:
    """Start a pool of workers and a batcher in front of it; stop both on exit.

    >>> async with open_batcher(process_workers(["sleep"], 8), PoolConfig(workers=8)) as batcher:
    ...     await batcher.submit("hello", tier="paid")
    'olleh'
    """
    async with trio.open_nursery() as nursery:
        workers = WorkerPool(pool, spawn, stats)
        observe = getattr(policy, "observe", None)
        if observe is not None:  # a policy that learns from calls (AIMD) hears every answer
            workers.on_answer = observe
        await nursery.start(workers.run)
        batcher = Batcher(workers, policy, queue)
        await nursery.start(batcher.run)
        yield batcher
        nursery.cancel_scope.cancel()


def _drop_time(deadline: float, drop_before: float) -> float:
    """The first clock reading ``now`` at which ``now + drop_before >= deadline`` holds in floats.

    ``deadline - drop_before`` can round one step too early, and a loop that woke there would
    find nothing to expire and wake again at once, for ever.
    """
    time = deadline - drop_before
    while time + drop_before < deadline:
        time = math.nextafter(time, math.inf)
    return time
