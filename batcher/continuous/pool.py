"""The continuous mode's backend: an EnginePool of engine worker processes behind a Router.

One replica per GPU, each an engine worker (``python -m workers engine``) kept alive by its own
:class:`~batcher.core.supervisor.Supervisor`, the fixed pool's supervision (spawn with its own
``CUDA_VISIBLE_DEVICES``, ``ready``, exit watch, restart with backoff). The pool's part::

    submit ─> too big for one replica's KV cache? 400 ─> Router: replica (least queued tokens,
           bounded prefix affinity) ─> admission in tokens: 529 ─> that replica's tier queues
    dispatch loop: expire queued jobs past their deadline (529, no prefill spent)
                   hand a replica the next job while it can start it soon ─> add frame
    a replica's frames, a step at a time: tokens ─> Output (detokenize; stream or hold)
                   finished ─> the rest and Finished; counters ─> load, rate, liveness

**Queues on the gateway side.** Each replica has tier queues in the pool (paid first, FIFO, with
the fixed mode's aging); its engine gets a job only while it has room for it now: fewer than
``max_seqs`` sequences, less than :data:`PREFILL_STEPS` steps' token budget of prompt not yet
prefilled, and free KV blocks by its last report. So a job waits in the pool. **Admission fails
fast**, at arrival (:mod:`batcher.continuous.estimate`). Once sent, a job runs to its end.

**Routing** happens at arrival (:mod:`batcher.continuous.router`): the load of a replica is the tokens it
still owes its jobs, queued here or running there; the prefix is the request's block hashes.
What a replica holds and how its engine's frames become events is :mod:`batcher.continuous.replica`.
With prefill and decode replicas apart, new work goes to the prefill ones, and each sequence moves
to a decode one after its first token (:mod:`batcher.continuous.handoff`).

**A replica that dies** (its process exits, breaks the protocol, or goes unheard past its
:class:`~batcher.continuous.silence.SilenceLimit`: killed) loses what it held. A job that has
shown its client nothing (a whole answer, or a stream with no delta yet) is re-run on another
replica, ahead of that replica's queue, and its client never learns of it; one that was lost
``max_attempts`` times fails (500), as does one that no replica takes within its tier's budget
of the loss (every engine down). A stream that has sent deltas ends with
:class:`~batcher.core.errors.ReplicaLost` (an SSE ``error`` of type ``api_error``, retryable):
never a silent restart, never a duplicate token, and the usage bills what was delivered; under
``on_engine_loss = "resume"`` it goes on on another replica from the ids it had instead
(:mod:`batcher.continuous.engine_loss`). Jobs only queued for the dead replica go to the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_loss import Fate, fate
from batcher.continuous.engine_process import EngineWorker
from batcher.continuous.estimate import PREFILL_STEPS, Estimates, blocks
from batcher.continuous.handoff import Handoffs
from batcher.continuous.long_prompts import lanes_of
from batcher.continuous.metrics import ContinuousCounters
from batcher.continuous.replica import Replica
from batcher.continuous.router import Router
from batcher.continuous.silence import SilenceLimit
from batcher.continuous.ticket import Stage, Ticket
from batcher.continuous.token_load import TokenLoad
from batcher.continuous.token_stream import Output
from batcher.core.admission import AdmissionControl
from batcher.core.backend import (
    Job,
    OnEvent,
    Snapshot,
    Status,
    Usage,
    WorkerStatus,
    not_ready_reason,
    top_tenants,
)
from batcher.core.config import QueueConfig
from batcher.core.errors import Expired, ReplicaLost, RequestFailed, Shed, Starting, TooLarge, WorkersFailed
from batcher.core.scaler import Fleet, leaving
from batcher.core.staffing import Staffing
from batcher.core.supervisor import Readiness, SlotStartError, Supervisor, start_slots
from batcher.core.tokenizer import Detokenizes
from workers.prefix_hash import prefix_hashes
from workers.protocol import Add

log = logging.getLogger("ferry.engines")


class EnginePool:
    """The continuous :class:`~batcher.core.backend.Backend` (see the module doc)."""

    def __init__(
        self,
        config: ContinuousModelConfig,
        queue: QueueConfig,
        spawn: Callable[[int], EngineWorker],
        tokenizer: Detokenizes,
    ) -> None:
        self.config, self.queue_config, self.tokenizer = config, queue, tokenizer
        self.counters = ContinuousCounters()
        silence, pool = config.silence(), config.pool_config()
        initial = pool.workers if pool.initial is None else pool.initial
        self.lanes = lanes = lanes_of(config)  # the long-prompt pool's slots follow the others
        self._readiness = Readiness(initial + lanes.long)
        self._replicas = [
            Replica(i, queue, self.counters, self._changed, self._readiness.answered)
            for i in range(lanes.ordinary + lanes.long)
        ]
        for r in self._replicas:
            r.supervisor = Supervisor(
                r.index,
                spawn,
                pool,
                self.counters,
                functools.partial(self._serve, r, silence),
                on_down=functools.partial(self._lost, r),
                on_retired=functools.partial(self._retired, r),
            )
        entry = lanes.ordinary - lanes.decode  # the replicas new work is routed to: 0..entry-1
        self._nursery: trio.Nursery | None = None
        self.admission = AdmissionControl(queue.wait_budgets) if queue.wait_budgets is not None else None
        # prompt tokens queued, by lane (ordinary, long) and tier: prefilled before they start
        self._prompts = [[0] * len(queue.tiers) for _ in range(2)]
        self.router = Router([0] * len(self._replicas), config.affinity_bound)
        self.staffing = Staffing(pool.workers, initial, lanes.long)
        self.estimates = Estimates(config, queue, self._replicas, lanes, self.admission, self._prompts,
                                   self.staffing)
        self.handoffs = Handoffs(self._replicas[entry:], config.max_seqs, config.block_size,
                                 self.counters, self._add, self.estimates.patience)
        for r in self._replicas[:entry] if config.disaggregated else ():
            r.on_handoff = self.handoffs.take
        self._rids = itertools.count(1)
        self._wakeup = trio.Event()

    # --- the Backend protocol -----------------------------------------------------------

    def submit(self, job: Job, on_event: OnEvent) -> Ticket:
        """Route and queue a job, or fail it at once: too large (400) or shed (529)."""
        now = trio.current_time()
        tier = (
            len(self.queue_config.tiers) - 1 if job.tier is None else self.queue_config.tier_index(job.tier)
        )
        wait = job.deadline if job.deadline is not None else self.estimates.patience(tier)
        hashes = prefix_hashes(job.prompt_tokens, self.config.block_size, self.config.name, job.tenant)
        ticket = Ticket(Output(job, on_event, self.tokenizer), tier, now, now + wait, hashes)
        error: TooLarge | Shed | Starting | None = self.estimates.too_large(job)
        if error is None and not any(self._replicas[i].up for i in self.estimates.candidates(ticket)):
            error = self.staffing.cold(now, self.queue_config.deadline(tier))
        if error is None:
            replica = self.estimates.route(ticket, self.router)
            if self.admission is not None:
                error = self.estimates.shed(ticket, self.estimates.long(ticket), now)
                if error is not None:
                    self.counters.shed[tier] += 1
        if error is not None:
            ticket.state = Stage.ENDED
            ticket.out.fail(error, retryable=not isinstance(error, TooLarge))
            return ticket
        self._enqueue(replica, ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller went away: out of its queue at once, or its sequence aborted."""
        state = ticket.state
        if state is Stage.ENDED:
            return
        self.counters.cancelled += 1
        r = self._replicas[ticket.replica]
        if state is Stage.QUEUED or state is Stage.RERUN:
            r.leave(ticket)
            if state is Stage.QUEUED:
                self._count(ticket, -1)
        else:
            r.end(ticket)

    @property
    def queued(self) -> int:
        """Prompt tokens waiting in the replicas' tier queues (0: nothing queued, re-runs aside)."""
        return sum(map(sum, self._prompts))

    def load(self, long: bool = False) -> TokenLoad:
        """When a queued job of the ordinary (or ``long``) lane would start (:class:`Estimates`)."""
        return self.estimates.load(long)

    def snapshot(self) -> Snapshot[ContinuousCounters]:
        """Each replica's engine as last reported, the pool's counters, the load in tokens."""
        counters = self.counters.copy()
        counters.replicas = tuple(r.replica_stats() for r in self._replicas)
        load = self.load()
        up = sum(r.up for r in self._replicas)
        reason = "" if self.ready else not_ready_reason(up, self._readiness.proven)
        staffing = self.staffing
        workers = tuple(self._reported(r) for r in self._replicas if r.index not in staffing.stopped)
        status = Status(
            self.ready, reason, workers, self.queued, "tokens",
            {"token_rate": load.rate, "cancelled": counters.cancelled, "expired": counters.expired,
             "reruns": counters.reruns, "interrupted": counters.interrupted, "resumed": counters.resumed,
             "start_seconds": staffing.start_seconds},
            top_tenants(self.estimates.backlogs()), scaling=staffing.scaling,
        )
        return Snapshot(self.config.mode, status, counters, load)

    def retune(self, queue: QueueConfig) -> None:
        """The tiers' new wait budgets, for arrivals from now on: admission judges by them and
        new jobs take them as deadlines (queued ones keep theirs). The tier names and order must
        be the ones this pool was opened with: queued tickets are filed by position."""
        opened = self.queue_config.tiers
        if queue.tiers != opened:
            raise ValueError(f"tiers: expected {list(opened)} as opened, got {list(queue.tiers)}")
        self.queue_config = self.estimates.queue = queue
        for r in self._replicas:
            r.queue.reweigh(queue.weights)
        if self.admission is not None and queue.wait_budgets is not None:
            self.admission.budgets = queue.wait_budgets

    @property
    def ready(self) -> bool:
        """A replica is up, and one has finished a sequence since every replica last died; or the
        scaler has taken every replica away (a request starts one: it takes traffic)."""
        return (any(r.up for r in self._replicas) and self._readiness.proven) or not self.staffing.staffed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every engine, report started once all are up, then dispatch until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            staffed = [r.supervisor for r in self._replicas if r.index not in self.staffing.stopped]
            await start_slots(nursery, staffed, self.config.name)
            nursery.start_soon(self._dispatch)
            task_status.started()

    # --- what a scaler does to the pool (batcher.core.scaling) ----------------------------

    @property
    def replicas(self) -> tuple[Replica, ...]:
        return tuple(self._replicas)

    def fleet(self) -> Fleet:
        """The replicas by role: up ones serve, staffed ones not yet up are starting; warm ones
        (up or starting) apart."""
        staffing = self.staffing
        away = staffing.stopped | staffing.leaving | staffing.fixed  # the long pool is not the scaler's
        staffed = [r for r in self._replicas if r.index not in away]
        serving = [r for r in staffed if r.index not in staffing.warm]
        up = [r for r in serving if r.up]
        warm = [r.up for r in staffed if r.index in staffing.warm]
        return Fleet(serving=len(up), starting=len(serving) - len(up), warm=sum(warm),
                     warming=len(warm) - sum(warm), idle=sum(not r.live for r in up))

    def start(self, count: int, warm: bool = False) -> None:
        """Start engines in up to ``count`` stopped slots, to serve or to be kept warm."""
        assert self._nursery is not None, "the pool runs"
        for index in self.staffing.next_stopped(count):
            r = self._replicas[index]
            self.staffing.started(index, trio.current_time(), warm)
            self._readiness.staffed(self.staffing.staffed)
            r.supervisor.rehire()
            self._nursery.start_soon(self._staff, r)

    def promote(self, count: int) -> None:
        """Up to ``count`` warm replicas that are up are routed jobs from now on."""
        ready = sorted(index for index in self.staffing.warm if self._replicas[index].up)
        self.staffing.warm.difference_update(ready[:count])
        self._changed()

    def retire(self, count: int) -> None:
        """Route nothing more to ``count`` replicas (starting ones, then idle, then busy); each
        stops once it holds no job (:meth:`_dispatch`)."""
        away = self.staffing.stopped | self.staffing.leaving | self.staffing.warm | self.staffing.fixed
        staffed = [(r.index, "starting" if not r.up else "busy" if r.live else "idle") for r in self._replicas
                   if r.index not in away]
        self.staffing.leaving.update(leaving(staffed, count))
        self._changed()

    def report(self, decision: str) -> None:
        self.staffing.scaling = decision

    def _reported(self, r: Replica) -> WorkerStatus:
        """``r`` as ``/readyz`` shows it: a leaving replica is draining, a warm one that is up warm."""
        status = r.status()
        if r.index in self.staffing.leaving:
            return dataclasses.replace(status, state="draining")
        if r.index in self.staffing.warm and r.up:
            return dataclasses.replace(status, state="warm")
        if self.lanes.is_long(r.index):
            return dataclasses.replace(status, details={**status.details, "long_pool": 1})
        return status

    async def _staff(self, r: Replica) -> None:
        try:
            await r.supervisor.run()
        except SlotStartError as exc:
            log.warning("%s: an engine added by the scaler did not start: %s", self.config.name, exc)
            self._retired(r)

    def _retired(self, r: Replica) -> None:
        """``r``'s engine is gone for good (drained and stopped, or it never started)."""
        self.staffing.retired(r.index)
        self._readiness.left(r.index)
        self._readiness.staffed(self.staffing.staffed)
        self._changed()

    # --- placement ----------------------------------------------------------------------

    def _enqueue(self, r: Replica, ticket: Ticket) -> None:
        r.enqueue(ticket)
        self._count(ticket, +1)
        self._changed()

    def _rerun(self, ticket: Ticket) -> None:
        """Queue a ticket lost with its engine at the front of another replica's work."""
        self.estimates.route(ticket, self.router).queue_rerun(ticket)

    def _count(self, ticket: Ticket, sign: int) -> None:
        """``ticket`` joins (+1) or leaves (-1) the tier queues: its prompt's tokens (less the
        prefix its replica holds) are what must be prefilled before it starts, in its lane."""
        prompt = ticket.cost - ticket.job.max_tokens
        self._prompts[self.estimates.long(ticket)][ticket.tier] += sign * prompt

    def _changed(self) -> None:
        self._wakeup.set()

    # --- the dispatch loop --------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Expire what waited too long and hand each replica what it can start; then sleep until
        the next deadline or a change (an arrival, an engine's step or report, an engine up)."""
        while True:
            now = trio.current_time()
            wake = self.handoffs.flush(now)
            stalled = self.handoffs.stalled  # no decode replica takes what a prefill one would make
            for r in self._replicas:
                wake = min(wake, self._expire(r, now))
                if r.up and not (stalled and r.on_handoff is not None):
                    self._fill(r, now)
                if self.staffing.drained(r.index, bool(r.live or r.queue.count or r.reruns)):
                    r.supervisor.retire()
            self._wakeup = trio.Event()
            with trio.move_on_at(wake):
                await self._wakeup.wait()

    def _expire(self, r: Replica, now: float) -> float:
        """Fail the tickets past their deadline; return the next deadline still to come."""
        expired, timed_out = r.expire(now)
        if expired:
            for ticket in expired:
                retry_after = self.estimates.retry_after(ticket, self.estimates.long(ticket), now)
                self._count(ticket, -1)
                self.counters.expired += 1
                error = Expired(f"not started within {now - ticket.arrival:.3f}s of arrival", retry_after)
                ticket.out.fail(error, retryable=True)
        for ticket in timed_out:
            self.counters.timed_out += 1
            ticket.out.fail(WorkersFailed("its engine was lost and no other took the request in time"), False)
        return r.next_deadline()

    def _fill(self, r: Replica, now: float) -> None:
        """Send ``r`` the next tickets while its engine can start them within about two steps."""
        config = self.config
        while r.can_start(config.max_seqs, PREFILL_STEPS * self.lanes.budget(r.index)):
            ticket = r.next_ticket(now)
            if ticket is None:
                return
            if ticket.state is Stage.PREFILLING:  # taken from the queues (a re-run's tokens were never there)
                self._count(ticket, -1)
            if not ticket.attempts:
                self.counters.queue_wait[ticket.tier].observe(now - ticket.arrival)
            self.router.sent(r.index, ticket.hashes)
            add = self._add(ticket, next(self._rids))
            held = len(add.prompt_tokens) + len(add.output_tokens) + 1
            r.start(ticket, add, blocks(held, config.block_size), now)

    def _add(self, ticket: Ticket, rid: int) -> Add:
        """The ``add`` frame of ``ticket`` as sequence ``rid``: after the ids it has taken (a stream
        resumed after its engine died, a sequence handed off after its first token)."""
        job, sampling = ticket.job, ticket.job.sampling
        if sampling.temperature is None:
            sampling = sampling.replace(temperature=self.config.temperature)  # the model's default
        weight = self.queue_config.weights.get(job.tenant, 1.0)
        taken = list(ticket.out.ids)
        return Add.of(rid, list(job.prompt_tokens), ticket.tier, job.tenant, sampling, weight, taken,
                      self.queue_config.tpot_target(ticket.tier))

    # --- engines coming and going -------------------------------------------------------

    async def _serve(self, r: Replica, silence: SilenceLimit, worker: EngineWorker) -> bool:
        self.staffing.ready(r.index, trio.current_time())
        self.router.resize(r.index, worker.first_stats.total_blocks)
        return await r.serve(worker, silence)

    def _lost(self, r: Replica) -> None:
        """``r``'s engine is gone (before anything awaits): re-run what showed its client
        nothing, end the streams that showed text, and move what only queued there."""
        now = trio.current_time()
        if r.index not in self.staffing.leaving:
            self._readiness.lost(r.index)
        self.router.forget(r.index)
        self.handoffs.forget(r, list(r.live.values()))
        lost = r.down()
        reruns, queued = r.evacuate(now)  # placed again elsewhere below
        for ticket in queued:
            self._count(ticket, -1)
        for ticket in lost:
            if ticket.ended:
                continue
            ticket.attempts += 1
            out = ticket.out
            end = fate(sent=out.sent, generated=out.generated, max_tokens=ticket.job.max_tokens,
                       attempts=ticket.attempts, max_attempts=self.config.max_attempts,
                       resume=self.config.on_engine_loss == "resume")
            if end is Fate.RERUN or end is Fate.RESUME:
                if end is Fate.RERUN:
                    self.counters.reruns += 1
                    out.restart()
                    ticket.rerun_due = now + self.queue_config.deadline(ticket.tier)
                else:  # its client is reading: it waits for an engine as long as an admitted job may
                    self.counters.resumed += 1
                    ticket.rerun_due = now + self.estimates.patience(ticket.tier)
                self._rerun(ticket)
                continue
            ticket.state = Stage.ENDED
            if end is Fate.COMPLETE:
                usage = Usage(len(ticket.job.prompt_tokens), 0, out.generated)
                out.finish("max_tokens", usage, ticket.queued)
            elif end is Fate.INTERRUPT:
                self.counters.interrupted += 1
                out.fail(ReplicaLost(
                    f"the engine serving this stream was lost after {out.sent} output tokens; "
                    "send the request again for a whole answer"), retryable=True)
            else:
                out.fail(RequestFailed(f"its engine was lost {ticket.attempts} times"), retryable=False)
        for ticket in reruns:  # a re-run still waiting stays one
            self._rerun(ticket)
        for ticket in queued:
            self._enqueue(self.estimates.route(ticket, self.router), ticket)
        self._changed()


@contextlib.asynccontextmanager
async def open_engine_pool(
    config: ContinuousModelConfig,
    queue: QueueConfig,
    spawn: Callable[[int], EngineWorker],
    tokenizer: Detokenizes,
) -> AsyncIterator[EnginePool]:
    """Start a model's engines and the pool in front of them; stop both on exit."""
    async with trio.open_nursery() as nursery:
        pool = EnginePool(config, queue, spawn, tokenizer)
        await nursery.start(pool.run)
        yield pool
        nursery.cancel_scope.cancel()
