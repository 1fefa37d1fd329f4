"""The continuous mode's backend: an EnginePool of engine worker processes behind a Router.

One replica per GPU, each an engine worker (``python -m workers engine``) kept alive by its own
:class:`~batcher.supervisor.Supervisor`, the fixed pool's supervision (spawn with its own
``CUDA_VISIBLE_DEVICES``, ``ready``, exit watch, restart with backoff). The pool's part::

    submit ─> too big for one replica's KV cache? 400 ─> Router: replica (least queued tokens,
           bounded prefix affinity) ─> admission in tokens: 529 ─> that replica's tier queues
    dispatch loop: expire queued jobs past their deadline (529, no prefill spent)
                   hand a replica the next job while it can start it soon ─> add frame
    a replica's frames, a step at a time: tokens ─> Output (detokenize; stream or hold)
                   finished ─> the rest and Finished; stats ─> load, rate, liveness

**Queues on the gateway side.** Each replica has tier queues in the pool (paid first, FIFO, with
the fixed mode's aging); its engine gets a job only while it has room for it now: fewer than
``max_seqs`` sequences, less than one step's token budget of prompt not yet prefilled, and free
KV blocks by its last report. So a job waits in the pool, where its deadline (its tier's wait
budget, or the job's own) can still pass: it then gets 529 :class:`~batcher.types.Expired`
before it has cost a prefill. Once sent, a job runs to its end.

**Routing** happens at arrival (:mod:`batcher.router`): the load of a replica is the tokens it
still owes its jobs, queued here or running there; the prefix is the request's block hashes.

**A replica that dies** (its process exits, breaks the protocol, or sends no ``stats`` for
``stats_timeout``: killed) loses what it held. A job that has shown its client nothing (a whole
answer, or a stream with no delta yet) is re-run on another replica, ahead of that replica's
queue, and its client never learns of it; one that was lost ``max_attempts`` times fails (500),
as does one that no replica takes within its tier's budget of the loss (every engine down). A
stream that has sent deltas ends with :class:`~batcher.types.ReplicaLost` (an SSE ``error`` of
type ``api_error``, retryable): never a silent restart, never a duplicate token, and the usage
bills what was delivered. Jobs only queued for the dead replica go to the others.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable

import trio

from batcher.admission import AdmissionControl
from batcher.backend import Job, OnEvent, Snapshot, Usage
from batcher.config import ContinuousModelConfig, QueueConfig
from batcher.engine_metrics import COUNTERS, ContinuousStats, ReplicaStats
from batcher.engine_worker import EngineProcess
from batcher.router import Router, prefix_hashes
from batcher.supervisor import Readiness, Supervisor
from batcher.tier_queue import TierQueues
from batcher.token_load import TokenLoad, TokenRate
from batcher.token_stream import Output, Tokenizer
from batcher.types import Expired, ReplicaLost, Request, RequestFailed, State, TooLarge, WorkersFailed
from workers.engine.block_manager import cdiv
from workers.protocol import Abort, Add, Finished, Message, ProtocolError, Stats, Tokens, WorkerLost, encode

log = logging.getLogger("ferry.engines")

STOP_REASONS = {"eos": "end_turn", "stop_token": "end_turn", "max_tokens": "max_tokens"}
"""An engine's finish reasons as the Messages API's stop reasons."""
STOP_IDS = ("eos", "stop_token")  # the last id of such a sequence is the stop token: not text


class _Job:
    """One submitted job: the ticket :meth:`EnginePool.cancel` takes."""

    __slots__ = ("out", "tier", "arrival", "deadline", "hashes", "cost", "replica", "request", "rid",
                 "dispatched_at", "remaining", "prefilling", "attempts", "rerun_due", "closed")

    def __init__(self, out: Output, tier: int, arrival: float, deadline: float, hashes: list[bytes]) -> None:
        self.out, self.tier, self.arrival, self.deadline, self.hashes = out, tier, arrival, deadline, hashes
        self.cost = 0  # tokens it adds to its queue: prompt not held by its replica + max_tokens
        self.replica = -1
        self.request: Request | None = None  # its place in a replica's tier queues, while queued
        self.rid = -1  # its sequence's number in the engine, once sent
        self.dispatched_at = arrival
        self.remaining = 0  # tokens its replica still owes it (the replica's load counts them)
        self.prefilling = False  # sent, and no token back yet
        self.attempts = 0  # times its replica died under it
        self.rerun_due = math.inf  # a re-run not taken by then fails
        self.closed = False  # its caller has its last event, or has gone: nothing more is emitted

    @property
    def job(self) -> Job:
        return self.out.job


class _Replica:
    """One engine worker slot and what the pool has given it."""

    def __init__(self, index: int, tiers: int, queue: QueueConfig) -> None:
        self.index = index
        self.supervisor: Supervisor[EngineProcess]
        self.up = False
        self.queue = TierQueues(tiers, queue.age_limit, queue.aged_share)
        self.waiting: dict[int, _Job] = {}  # request id -> job, in its tier queues
        self.reruns: deque[_Job] = deque()  # lost elsewhere, waiting here: they go first
        self.live: dict[int, _Job] = {}  # rid -> job, sent to its engine
        self.load = 0  # tokens owed to its jobs (the router's measure)
        self.prefilling = 0  # prompt tokens sent with no token back yet
        self.free_blocks = 0  # its engine's last report, less what was sent since
        self.total_blocks = 0
        self.stats: Stats | None = None
        self.stats_at = 0.0
        self.busy = False  # its engine had work at its last report
        self.computed, self.generated = TokenRate(), TokenRate()
        self.carried = dict.fromkeys(COUNTERS, 0)  # counters of its dead engines
        self.outbox: list[bytes] = []
        self.outbox_ready = trio.Event()
        self.served = False


class EnginePool:
    """The continuous :class:`~batcher.backend.Backend` (see the module doc)."""

    def __init__(
        self,
        config: ContinuousModelConfig,
        queue: QueueConfig,
        spawn: Callable[[int], EngineProcess],
        tokenizer: Tokenizer,
    ) -> None:
        self.config, self.queue_config, self.tokenizer = config, queue, tokenizer
        self.stats = ContinuousStats()
        pool = config.pool()
        tiers = len(queue.tiers)
        self._replicas = [_Replica(i, tiers, queue) for i in range(config.workers)]
        for r in self._replicas:
            r.supervisor = Supervisor(
                r.index, spawn, pool, self.stats, functools.partial(self._serve, r),
                on_down=functools.partial(self._lost, r),
            )
        self.router = Router([0] * config.workers, config.affinity_bound)
        self.admission = AdmissionControl(queue.wait_budgets) if queue.wait_budgets is not None else None
        self._queued = [0] * tiers  # tokens waiting in the pool's queues, by tier
        self._readiness = Readiness(config.workers)
        self._rids = itertools.count(1)
        self._ids = itertools.count(1)
        self._wakeup = trio.Event()

    # --- the Backend protocol -----------------------------------------------------------

    def submit(self, job: Job, on_event: OnEvent) -> _Job:
        """Route and queue a job, or fail it at once: too large (400) or shed (529)."""
        now = trio.current_time()
        tiers = self.queue_config.tiers
        tier = len(tiers) - 1 if job.tier is None else self.queue_config.tier_index(job.tier)
        wait = job.deadline if job.deadline is not None else self.queue_config.deadline(tier)
        hashes = prefix_hashes(job.prompt_tokens, self.config.block_size, self.config.name, job.tenant)
        entry = _Job(Output(job, on_event, self.tokenizer), tier, now, now + wait, hashes)
        error = self._too_large(job)
        if error is not None:
            entry.closed = True
            entry.out.fail(error, retryable=False)
            return entry
        replica = self._route(entry)
        if self.admission is not None:
            shed = self.admission.shed(self.load(), tier, now, entry.cost)
            if shed is not None:
                self.stats.shed[tier] += 1
                entry.closed = True
                entry.out.fail(shed, retryable=True)
                return entry
        self._enqueue(replica, entry)
        return entry

    def cancel(self, entry: _Job) -> None:
        """The caller went away: out of its queue at once, or its sequence aborted."""
        if entry.closed:
            return
        entry.closed = True
        self.stats.cancelled += 1
        now = trio.current_time()
        r = self._replicas[entry.replica]
        if entry.request is not None and entry.request.state is State.QUEUED:
            entry.request.cancel(now)
            r.queue.discard(entry.request)
            self._unqueue(r, entry)
        elif r.live.get(entry.rid) is entry:
            self._send(r, Abort(entry.rid))  # its blocks are free by the engine's next step
        else:  # a re-run waiting in r.reruns: skipped when it reaches the front
            self._owe(r, entry, 0)

    def load(self) -> TokenLoad:
        """Queued tokens per tier against the fleet's measured rate (DESIGN §8)."""
        rate = sum(r.computed.value for r in self._replicas if r.up)
        arrivals = self.admission.arrivals(trio.current_time()) if self.admission is not None else ()
        return TokenLoad(tuple(self._queued), rate, arrivals)

    def snapshot(self) -> Snapshot:
        """Each replica's engine as last reported, the pool's counters, the load."""
        stats = self.stats.copy()
        stats.replicas = tuple(self._replica_stats(r) for r in self._replicas)
        status = {
            "workers": [
                {"slot": r.index, "pid": r.supervisor.worker.pid if r.up and r.supervisor.worker else None,
                 "state": "up" if r.up else "starting", "restarts": r.supervisor.restarts,
                 "queued": r.queue.count + len(r.reruns), "load_tokens": r.load,
                 **({name: getattr(r.stats, name) for name in ("running", "waiting", "used_blocks",
                     "free_blocks", "total_blocks")} if r.up and r.stats else {})}
                for r in self._replicas
            ],
            "queued_tokens": sum(self._queued),
            "token_rate": self.load().rate,
            "cancelled": stats.cancelled, "expired": stats.expired, "reruns": stats.retries,
            "interrupted": stats.interrupted,
        }
        return Snapshot(self.ready, status, stats, self.load())

    @property
    def ready(self) -> bool:
        return any(r.up for r in self._replicas) and self._readiness.proven

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every engine, report started once all are up, then dispatch until cancelled."""
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as starting:
                for r in self._replicas:
                    starting.start_soon(nursery.start, r.supervisor.run)
            nursery.start_soon(self._dispatch)
            task_status.started()

    # --- placement ----------------------------------------------------------------------

    def _too_large(self, job: Job) -> TooLarge | None:
        bs = self.config.block_size
        needed = cdiv(len(job.prompt_tokens) + job.max_tokens, bs)
        capacity = max(r.total_blocks for r in self._replicas)
        if needed <= capacity:
            return None
        return TooLarge(
            f"prompt is too long for this model's KV cache: {len(job.prompt_tokens)} prompt tokens + "
            f"max_tokens {job.max_tokens} need {needed} blocks of {bs} tokens; one replica holds "
            f"{capacity} ({capacity * bs} tokens)"
        )

    def _route(self, entry: _Job) -> _Replica:
        """The replica for ``entry`` (a down one only when every replica is down), and its cost."""
        loads = [r.load if r.up else None for r in self._replicas]
        if not any(r.up for r in self._replicas):
            loads = [r.load for r in self._replicas]
        route = self.router.choose(loads, entry.hashes)
        entry.replica = route.replica
        job = entry.job
        entry.cost = len(job.prompt_tokens) - route.held_blocks * self.config.block_size + job.max_tokens
        return self._replicas[route.replica]

    def _enqueue(self, r: _Replica, entry: _Job) -> None:
        request = Request(next(self._ids), "", entry.tier, entry.arrival, entry.deadline,
                          functools.partial(self._left_queue, entry))
        entry.request = request
        r.waiting[request.id] = entry
        r.queue.push(request)
        self._queued[entry.tier] += entry.cost
        self._owe(r, entry, entry.cost)
        self._wakeup.set()

    def _unqueue(self, r: _Replica, entry: _Job, owed: int = 0) -> None:
        """``entry`` leaves ``r``'s queues; it still owes ``owed`` tokens there (sent: its cost)."""
        del r.waiting[entry.request.id]  # type: ignore[union-attr]
        self._queued[entry.tier] -= entry.cost
        self._owe(r, entry, owed)
        entry.request = None

    def _left_queue(self, entry: _Job, request: Request) -> None:
        """A queued job's request failed (expired) or was cancelled."""
        if request.state is State.FAILED:
            self._unqueue(self._replicas[entry.replica], entry)
            self.stats.expired += 1
            entry.closed = True
            entry.out.fail(request.error, retryable=True)  # type: ignore[arg-type]

    def _owe(self, r: _Replica, entry: _Job, tokens: int) -> None:
        r.load += tokens - entry.remaining
        entry.remaining = tokens

    # --- the dispatch loop --------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Expire what waited too long, hand each replica what it can start; sleep until the
        next deadline or until something changes (an arrival, a step, a report, an engine up)."""
        while True:
            now = trio.current_time()
            wake = math.inf
            for r in self._replicas:
                wake = min(wake, self._expire(r, now))
                if r.up:
                    self._fill(r, now)
            self._wakeup = trio.Event()
            with trio.move_on_at(wake):
                await self._wakeup.wait()

    def _expire(self, r: _Replica, now: float) -> float:
        """Fail the jobs past their deadline; the next deadline still to come."""
        expired = r.queue.expire(now)
        load = self.load() if expired else None
        for request in expired:
            retry_after = self.admission.retry_after(load, request.tier, now) if self.admission else 1.0
            waited = now - request.arrival
            request.fail(Expired(f"not started within {waited:.3f}s of arrival", retry_after), now)
        for entry in [e for e in r.reruns if not e.closed and e.rerun_due <= now]:
            entry.closed = True
            self._owe(r, entry, 0)
            self.stats.timed_out += 1
            entry.out.fail(WorkersFailed("its engine was lost and no other took the request in time"), False)
        return min(r.queue.next_deadline(), min((e.rerun_due for e in r.reruns if not e.closed), default=math.inf))

    def _fill(self, r: _Replica, now: float) -> None:
        config = self.config
        while len(r.live) < config.max_seqs and r.prefilling < config.max_batch_tokens and r.free_blocks > 0:
            entry = self._next(r, now)
            if entry is None:
                return
            job = entry.job
            entry.rid = rid = next(self._rids)
            entry.dispatched_at, entry.prefilling = now, True
            entry.rerun_due = math.inf
            r.live[rid] = entry
            if not entry.attempts:
                self.stats.queue_wait[entry.tier].observe(now - entry.arrival)
            r.prefilling += len(job.prompt_tokens)
            r.free_blocks -= cdiv(len(job.prompt_tokens) + 1, config.block_size)
            self.router.sent(r.index, entry.hashes)
            sampling = job.sampling
            self._send(r, Add(
                rid, list(job.prompt_tokens), job.max_tokens, entry.tier, job.tenant,
                1.0 if sampling.temperature is None else sampling.temperature,
                1.0 if sampling.top_p is None else sampling.top_p,
                0 if sampling.top_k is None else sampling.top_k,
                sampling.seed, [], False,
            ))

    def _next(self, r: _Replica, now: float) -> _Job | None:
        while r.reruns:
            entry = r.reruns.popleft()
            if not entry.closed:
                return entry
        taken = r.queue.take(1, now)
        if not taken:
            return None
        entry = r.waiting[taken[0].id]
        self._unqueue(r, entry, entry.cost)
        return entry

    def _send(self, r: _Replica, message: Add | Abort) -> None:
        r.outbox.append(encode(message))
        r.outbox_ready.set()

    # --- one replica's engine -----------------------------------------------------------

    async def _serve(self, r: _Replica, worker: EngineProcess) -> bool:
        """Talk to a started engine until it must die; True if it finished a sequence."""
        now = trio.current_time()
        r.up, r.served, r.outbox = True, False, []
        r.stats, r.stats_at, r.busy = worker.first_stats, now, False
        r.free_blocks, r.total_blocks = worker.first_stats.free_blocks, worker.first_stats.total_blocks
        r.computed.restart()
        r.generated.restart()
        self.router.resize(r.index, r.total_blocks)
        self._wakeup.set()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, r, worker)
                await self._read(r, worker)
                nursery.cancel_scope.cancel()
        except* (WorkerLost, ProtocolError) as group:
            log.warning("engine %d (pid %s) lost: %s; restarting it", r.index, worker.pid, group.exceptions[0])
        return r.served

    async def _write(self, r: _Replica, worker: EngineProcess) -> None:
        while True:
            await r.outbox_ready.wait()
            r.outbox_ready = trio.Event()
            frames, r.outbox = r.outbox, []
            await worker.send(b"".join(frames))

    async def _read(self, r: _Replica, worker: EngineProcess) -> None:
        timeout = self.config.stats_timeout_ms / 1000
        while True:
            with trio.move_on_at(r.stats_at + timeout):
                messages = await worker.receive()
                self._step(r, messages, trio.current_time())
                continue
            log.warning("engine %d (pid %s) sent no stats for %.1fs: killing it", r.index, worker.pid, timeout)
            return

    def _step(self, r: _Replica, messages: list[Message], now: float) -> None:
        """One read's frames (a step's, or several): every event they cause, in one pass."""
        ended = {m.rid: m.reason for m in messages if isinstance(m, Finished)}
        for message in messages:
            if isinstance(message, Tokens):
                self._tokens(r, message, ended.get(message.rid), now)
            elif isinstance(message, Finished):
                self._finished(r, message)
            elif isinstance(message, Stats):
                self._report(r, message, now)
            else:
                raise ProtocolError(f"unexpected {message.kind} frame from an engine")
        self._wakeup.set()

    def _tokens(self, r: _Replica, frame: Tokens, ended: str | None, now: float) -> None:
        entry = r.live.get(frame.rid)
        if entry is None or entry.closed:
            return
        job = entry.job
        if entry.prefilling:
            entry.prefilling = False
            r.prefilling -= len(job.prompt_tokens)
        visible = len(frame.ids) - (ended in STOP_IDS)
        queued = entry.dispatched_at - entry.arrival
        if entry.out.push(frame.ids, visible, queued):  # a whole answer reached a stop sequence
            entry.closed = True
            self._send(r, Abort(frame.rid))
            entry.out.finish("end_turn", Usage(len(job.prompt_tokens), entry.out.generated), queued)
        self._owe(r, entry, max(0, job.max_tokens - entry.out.generated))

    def _finished(self, r: _Replica, frame: Finished) -> None:
        entry = r.live.pop(frame.rid, None)
        if entry is None:
            return
        if entry.prefilling:
            r.prefilling -= len(entry.job.prompt_tokens)
        self._owe(r, entry, 0)
        r.served = True
        self._readiness.answered()
        if entry.closed:
            return
        entry.closed = True
        usage = frame.usage
        if frame.reason in STOP_REASONS:
            queued = entry.dispatched_at - entry.arrival
            entry.out.finish(STOP_REASONS[frame.reason], Usage(usage.prompt_tokens, usage.output_tokens,
                                                               usage.cached_tokens), queued)
        elif frame.reason == "too_long":
            error = self._too_large(entry.job) or TooLarge("the request outgrew one replica's KV cache")
            entry.out.fail(error, retryable=False)
        else:
            entry.out.fail(RequestFailed(f"the engine ended the request ({frame.reason})"), retryable=True)

    def _report(self, r: _Replica, stats: Stats, now: float) -> None:
        last = r.stats
        if last is not None and stats.step > last.step:
            steps = stats.step - last.step
            self.stats.step_tokens.observe((stats.computed_tokens - last.computed_tokens) / steps, steps)
        busy = stats.running + stats.waiting > 0
        r.computed.update(now, stats.computed_tokens, busy and r.busy)
        r.generated.update(now, stats.generated_tokens)
        r.stats, r.stats_at, r.busy, r.free_blocks = stats, now, busy, stats.free_blocks

    def _lost(self, r: _Replica) -> None:
        """The replica's engine is gone (on_down: before anything awaits): settle what it held."""
        now = trio.current_time()
        if r.stats is not None:
            for name in COUNTERS:
                r.carried[name] += getattr(r.stats, name)
        r.up, r.stats, r.outbox, r.prefilling = False, None, [], 0
        self._readiness.lost(r.index)
        self.router.forget(r.index)
        lost, r.live = list(r.live.values()), {}
        moved = [e for e in r.reruns if not e.closed]
        r.reruns.clear()
        for request in r.queue.take(r.queue.count, now):
            entry = r.waiting[request.id]
            self._unqueue(r, entry)
            moved.append(entry)
        for entry in lost:
            self._owe(r, entry, 0)
            if entry.closed:
                continue
            entry.attempts += 1
            if entry.out.sent:
                entry.closed = True
                self.stats.interrupted += 1
                entry.out.fail(ReplicaLost(
                    f"the engine serving this stream was lost after {entry.out.sent} output tokens; "
                    "send the request again for a whole answer"), retryable=True)
            elif entry.attempts >= self.config.max_attempts:
                entry.closed = True
                entry.out.fail(RequestFailed(f"its engine was lost {entry.attempts} times"), retryable=False)
            else:
                self.stats.retries += 1
                entry.out.restart()
                entry.rerun_due = now + self.queue_config.deadline(entry.tier)
                target = self._route(entry)
                self._owe(target, entry, entry.cost)
                target.reruns.append(entry)
        for entry in moved:
            if entry.rerun_due < math.inf:  # a re-run still waiting: it stays one
                target = self._route(entry)
                self._owe(target, entry, entry.cost)
                target.reruns.append(entry)
            else:
                self._enqueue(self._route(entry), entry)
        self._wakeup.set()

    def _replica_stats(self, r: _Replica) -> ReplicaStats:
        now = r.stats
        counters = {name: r.carried[name] + (getattr(now, name) if now else 0) for name in COUNTERS}
        gauges = {name: getattr(now, name) if now else 0
                  for name in ("running", "waiting", "free_blocks", "used_blocks", "cached_blocks")}
        return ReplicaStats(r.index, r.total_blocks, r.generated.value if r.up else 0.0, **gauges, **counters)


@contextlib.asynccontextmanager
async def open_engine_pool(
    config: ContinuousModelConfig, queue: QueueConfig, spawn: Callable[[int], EngineProcess], tokenizer: Tokenizer
) -> AsyncIterator[EnginePool]:
    """Start a model's engines and the pool in front of them; stop both on exit."""
    async with trio.open_nursery() as nursery:
        pool = EnginePool(config, queue, spawn, tokenizer)
        await nursery.start(pool.run)
        yield pool
        nursery.cancel_scope.cancel()
