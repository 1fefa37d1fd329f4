"""The fixed-batch Batcher: collect requests, flush them as batches, hand batches to the pool.

Four ways in. ``submit(job, on_event)``/``cancel`` are the :class:`~batcher.core.backend.Backend`
protocol the HTTP bridge speaks: a finished request emits ``Started``, one ``Delta`` with its
whole output and ``Finished``; a failed one emits ``Failed``. ``request``/``enqueue`` are the
same synchronous door for code on the trio thread that wants the :class:`~batcher.core.errors.Request`
itself; ``answer`` is the awaitable a library user wants; ``feed`` takes :class:`Arrivals`,
requests known before they arrive (a trace), admitted at each wake-up with their own arrival
times, the loop waking early only for one that would have woken it, so that the clock stops only
where there is something to decide. Every outcome leaves through the request's ``on_done``.

The flush loop is a thin shell around two pure objects, the :class:`~batcher.core.tier_queue.TierQueues`
and the flush policy. It asks the policy what to do, does it, and otherwise sleeps until the
earliest of: the policy's timer, the next request deadline, the queue reaching the policy's size
trigger, or a worker freeing up. It never polls.

    submit/enqueue ──> TierQueues ──policy says Flush──> WorkerPool.dispatch ──> worker
                          │                                      │
                          └── deadline passed: Overloaded        └── outputs ──> on_done
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import trio

from batcher.core.admission import AdmissionControl, BatchLoad
from batcher.core.backend import (
    Delta,
    Failed,
    Finished,
    Job,
    OnEvent,
    Snapshot,
    Started,
    Status,
    Usage,
    Vector,
    WorkerStatus,
    not_ready_reason,
    top_tenants,
)
from batcher.core.config import TEXT, Outputs, PoolConfig, QueueConfig
from batcher.core.errors import Expired, Overloaded
from batcher.core.tier_queue import TierQueues
from batcher.fixed.counters import BatchCounters
from batcher.fixed.policy import Flush, Policy, QueueState, SizeOrTimeout
from batcher.fixed.pool import WorkerPool
from batcher.fixed.request import Request, RequestState
from batcher.fixed.slot import SlotState, Spawn


class Arrivals(Protocol):
    """Requests known before they arrive, handed to :meth:`Batcher.feed`."""

    def due(self, now: float) -> list[Request]:
        """The requests that have arrived by ``now`` and were not yet taken, each made with its
        own arrival time (:meth:`Batcher.request`), in order of arrival."""

    def next_wake(self, more: int, until: float, drop_before: float) -> float:
        """When the loop must wake for the requests still to come, if before ``until`` (else
        inf): at the one that brings ``more`` to the queue, or at the first whose deadline less
        ``drop_before`` comes before ``until``."""


class DeadlineUnreachable(Expired):
    """Given up before dispatch: too little time was left to answer before its deadline."""


def _ignore(request: Request) -> None:
    pass


def utf8_tokens(text: str) -> int:
    """The default token count of an output: its UTF-8 bytes (the ``bytes`` tokenizer)."""
    return len(text.encode("utf-8", "surrogatepass"))


class Batcher:
    def __init__(
        self, pool: WorkerPool, policy: Policy, queue: QueueConfig, tokens: Callable[[str], int] = utf8_tokens
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.config = queue
        self.counters = pool.counters
        self.queue: TierQueues[Request] = TierQueues(len(queue.tiers), queue.age_limit, queue.aged_share,
                                waiting=RequestState.QUEUED, taken=RequestState.DISPATCHED,
                                weights=queue.weights)
        self._tokens = tokens  # counts an output's tokens for its events: the model's tokenizer
        self._ids = itertools.count(1)
        self._wakeup = trio.Event()
        self._wake_at_count = 1
        self._wake_at_time = math.inf
        self._drop_before: float = getattr(policy, "drop_before", 0.0)
        self._arrivals: Arrivals | None = None
        budgets = queue.wait_budgets
        self.admission = AdmissionControl(budgets) if budgets is not None else None
        pool.on_idle = self._worker_idle

    # --- the Backend protocol (batcher.core.backend) --------------------------------------------

    def submit(self, job: Job, on_event: OnEvent) -> Request:
        """Queue a job; its events go to ``on_event``. Raises ``ValueError`` for an unknown tier."""
        emit = functools.partial(self._emit, on_event, len(job.prompt_tokens))
        request = self.request(job.prompt, job.tier, job.deadline, on_done=emit, tenant=job.tenant)
        self.enqueue(request)
        return request

    def _emit(self, on_event: OnEvent, input_tokens: int, request: Request) -> None:
        """A request's end as events: a finished one's whole output is one delta (one vector,
        worth no output tokens, from an embedding model)."""
        if request.state is RequestState.DONE:
            output = request.output or ""
            assert request.dispatched_at is not None, "a done request was dispatched"
            on_event(Started(request.dispatched_at - request.arrival))
            if isinstance(output, bytes):
                tokens = 0
                on_event(Vector(output))
            else:
                tokens = self._tokens(output)
                if output:
                    on_event(Delta(output, tokens))
            on_event(Finished("end_turn", Usage(prompt_tokens=input_tokens, cached_tokens=0,
                                                output_tokens=tokens)))
        elif request.state is RequestState.FAILED:
            error = request.error
            assert error is not None, "a failed request has its error"
            on_event(Failed(error, retryable=isinstance(error, Overloaded)))

    def snapshot(self) -> Snapshot[BatchCounters]:
        """The pool's workers and the batcher's counters, copied for /readyz and /metrics."""
        workers = tuple(WorkerStatus(w.slot, w.pid, w.state.value, w.restarts, placement=w.placement)
                        for w in self.pool.workers())
        counters, ready = self.counters, self.pool.ready
        up = [w for w in workers if w.up]
        if ready:
            reason = ""
        elif up and all(w.state == SlotState.HUNG.value for w in up):
            reason = "every worker is hung past its hang timeout"
        else:
            reason = not_ready_reason(len(up), ready)
        status = Status(ready, reason, workers, self.queue.count, "requests", {
            "flushed": counters.flushed_requests, "cancelled": counters.cancelled,
            "expired": counters.expired,
            "calls": counters.calls, "retries": counters.retries,
            "call_seconds": self.pool.call_seconds,  # recent call time: what admission plans with
            "start_seconds": self.pool.staffing.start_seconds,  # the last measured start: a cold one's wait
        }, top_tenants(self.queue.backlogs()), scaling=self.pool.staffing.scaling)
        return Snapshot("fixed", status, counters.copy(), self.load())

    def retune(self, queue: QueueConfig) -> None:
        """The tiers' new wait budgets, for arrivals from now on: admission judges by them and
        new requests take them as deadlines (queued ones keep theirs). The tier names and order
        must be the ones this batcher was opened with: queued requests are filed by position."""
        if queue.tiers != self.config.tiers:
            raise ValueError(f"tiers: expected {list(self.config.tiers)} as opened, got {list(queue.tiers)}")
        self.config = queue
        self.queue.reweigh(queue.weights)
        if self.admission is not None and queue.wait_budgets is not None:
            self.admission.budgets = queue.wait_budgets

    def request(
        self,
        input: str,
        tier: str | None = None,
        timeout: float | None = None,
        on_done: Callable[[Request], None] = _ignore,
        arrival: float | None = None,
        tenant: str = "",
    ) -> Request:
        """A new request arriving now, or at ``arrival`` (one of :class:`Arrivals`, made when due).

        ``tier`` defaults to the lowest; ``timeout`` (seconds after arrival) to the tier's wait
        budget where the config has budgets (the same budget admission judges by), else to its
        ``queue_timeout``; ``tenant`` is who pays (its share of its tier).
        """
        now = trio.current_time() if arrival is None else arrival
        index = len(self.config.tiers) - 1 if tier is None else self.config.tier_index(tier)
        wait = timeout if timeout is not None else self.config.deadline(index)
        return Request(next(self._ids), input, index, now, now + wait, on_done, tenant=tenant)

    def enqueue(self, request: Request) -> None:
        """Queue a request (trio thread, no await); its outcome arrives through ``on_done``.

        With wait budgets configured, a request whose estimated wait exceeds its tier's budget
        is shed at once (:class:`~batcher.core.errors.Overloaded`, with ``retry_after``).
        """
        if not self._admitted(request):
            return
        self.queue.push(request)
        if (
            self.queue.count >= self._wake_at_count
            or request.deadline - self._drop_before < self._wake_at_time
        ):
            self._wakeup.set()

    def _admitted(self, request: Request) -> bool:
        """Admission by load (:mod:`batcher.core.admission`), judged at arrival: False if shed;
        at a fleet with no worker up, a cold start that would outlast its wait is refused first."""
        cold = self.pool.cold(request.arrival, request.deadline - request.arrival)
        if cold is not None:
            request.fail(cold, request.arrival)
            return False
        if self.admission is None:
            return True
        load = self._seen_by(self.load(), request.tier, request.tenant)
        error = self.admission.shed(load, request.tier, request.arrival, tenant=request.tenant)
        if error is None:
            return True
        self.counters.shed[request.tier] += 1
        request.fail(error, request.arrival)
        return False

    def cancel(self, request: Request) -> None:
        """The caller has gone: leave the queue at once, or drop the output if already running."""
        if request.done:
            return
        queued = request.state is RequestState.QUEUED
        request.cancel(trio.current_time())
        self.counters.cancelled += 1
        if queued:
            self.queue.discard(request)
        else:
            self.pool.cancelled(request)

    def feed(self, arrivals: Arrivals) -> None:
        """Admit the requests of ``arrivals`` too, each when it is due (see the module doc)."""
        self._arrivals = arrivals
        self._wakeup.set()

    async def answer(self, input: str, tier: str | None = None, timeout: float | None = None) -> str | bytes:
        """Run one input through a batch and return its output.

        Raises :class:`~batcher.core.errors.Overloaded` if no worker took it before ``timeout``
        (default: the queue config's), :class:`~batcher.core.errors.RequestFailed` if its input failed
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
            for request in self._arrivals.due(now) if self._arrivals is not None else ():
                if self._admitted(request):
                    queue.push(request)
            if queue.count:
                self._expire(now)
            deadline, openings = queue.next_deadline(), pool.openings()
            decision = policy.decide(
                QueueState(now, queue.count, queue.oldest_arrival(), openings.takers(now), deadline)
            )
            if isinstance(decision, Flush):
                batch = queue.take(decision.size, now)
                self.counters.flushes[decision.reason] += 1
                self.counters.flushed_requests += len(batch)
                pool.dispatch(batch, decision.reason, now)
                continue
            self._wake_at_count = decision.queued
            self._wake_at_time = wake = min(decision.until, _drop_time(deadline, drop_before))
            if queue.count:  # a busy worker nearing the end of its call may take the next batch
                wake = min(wake, openings.next_opening(now))
            if self._arrivals is not None:  # with admission, each arrival is judged on time
                more = 1 if self.admission is not None else decision.queued - queue.count
                wake = min(wake, self._arrivals.next_wake(more, wake, drop_before))
            self._wakeup = trio.Event()
            with trio.move_on_at(wake):
                await self._wakeup.wait()

    def load(self) -> BatchLoad:
        """Queued requests per tier and when each live worker takes its next batch, for admission.

        A batch is the policy's size limit; a call lasts the recent call time (0 until one has
        been answered).
        """
        now = trio.current_time()
        queued = tuple(self.queue.queued(tier) for tier in range(len(self.config.tiers)))
        limit: int = getattr(self.policy, "limit", 0)  # optional attributes of a policy
        batch: int = limit or getattr(self.policy, "max_batch", 1)
        arrivals = self.admission.arrivals(now) if self.admission is not None else ()
        free_in = tuple(self.pool.openings().free_in(now))
        return BatchLoad(queued, free_in, batch, self.pool.call_seconds, arrivals)

    def _seen_by(self, load: BatchLoad, tier: int, tenant: str) -> BatchLoad:
        """``load`` as a new request of ``tenant`` in ``tier`` sees it: of its tier's queue, the
        part fair shares take before it (all of it while one tenant queues)."""
        ahead = self.queue.ahead(tier, tenant)
        if ahead == load.queued[tier]:
            return load
        return dataclasses.replace(load, queued=(*load.queued[:tier], ahead, *load.queued[tier + 1:]))

    def _retry_after(self, load: BatchLoad, request: Request, now: float) -> float:
        """When the queue ahead of ``request`` should have drained (its 529's Retry-After): its
        tenant's own backlog, within its tier."""
        if self.admission is not None:
            return self.admission.retry_after(load, request.tier, now, tenant=request.tenant)
        return max(load.dispatch_in(request.tier), 1.0 / load.drain_rate if load.drain_rate else 1.0)

    def _expire(self, now: float) -> None:
        """Fail the queued requests past their deadline, or too near it for the policy."""
        expired = self.queue.expire(now + self._drop_before)
        if not expired:
            return
        load = self.load()
        for request in expired:
            self.counters.expired += 1
            waited = now - request.arrival
            retry_after = self._retry_after(load, request, now)
            if self._drop_before:
                left = request.deadline - now
                message = f"{left:.3f}s left before its deadline after {waited:.3f}s"
                error: Overloaded = DeadlineUnreachable(message, retry_after)
            else:
                error = Expired(f"not dispatched within {waited:.3f}s of arrival", retry_after)
            request.fail(error, now)

    def _worker_idle(self) -> None:
        if self.queue.count or self._arrivals is not None:  # arrivals may be due for it
            self._wakeup.set()


@contextlib.asynccontextmanager
async def open_batcher(
    spawn: Spawn,
    pool: PoolConfig = PoolConfig(),
    policy: Policy = SizeOrTimeout(),
    queue: QueueConfig = QueueConfig(),
    counters: BatchCounters | None = None,
    tokens: Callable[[str], int] = utf8_tokens,
    outputs: Outputs = TEXT,
) -> AsyncIterator[Batcher]:
    """Start a pool of workers and a batcher in front of it; stop both on exit.

    ``tokens`` counts an output's tokens (the model's tokenizer); ``outputs`` says what every
    answer must be (texts, or vectors of a length).

    >>> spawn = process_workers(["sleep"], 8, kind=ProcessWorker)
    >>> async with open_batcher(spawn, PoolConfig(workers=8)) as batcher:
    ...     await batcher.answer("hello", tier="paid")
    'olleh'
    """
    observe = getattr(policy, "observe", None)
    if observe is not None:  # a policy that learns from calls (AIMD) forms a batch after the last answer
        pool = dataclasses.replace(pool, dispatch_ahead=0.0)
    async with trio.open_nursery() as nursery:
        workers = WorkerPool(pool, spawn, counters, outputs)
        if observe is not None:  # ...and hears every answer
            workers.on_answer = observe
        await nursery.start(workers.run)
        front = Batcher(workers, policy, queue, tokens)
        await nursery.start(front.run)
        yield front
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
