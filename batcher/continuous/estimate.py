"""Where the engine pool places a new job and what it estimates for admission: its replica (the
router's choice among its lane's), when it would start (its lane's token backlog, and under a
TPOT target when a seat frees on its replica), how long it may wait, whether it fits a
replica's KV cache at all, and each tenant's backlog.

**Admission fails fast**: the tier's wait budget is judged at arrival, where a job the estimate
says cannot start within it gets 529 with its Retry-After at once; an admitted job then waits
until it starts, never failing for having waited its budget (only a job's own deadline, or the
queue's 30 s backstop, can pass in the queue: 529 :class:`~batcher.core.errors.Expired` before
it has cost a prefill). The estimate is the larger of two waits: the lane's token backlog
(:mod:`batcher.continuous.token_load`) and, where a tier promises a TPOT, the wait for a seat on
the job's replica (:mod:`batcher.continuous.seat_wait`).

The pool (:mod:`batcher.continuous.pool`) owns the replicas and the queues; this reads them.
The seat wait needs the engines' step prices: the ``step_costs`` file they read, loaded here
too, so that the gateway prices a seat as its engines will (no file: no seat wait)."""

from __future__ import annotations

import dataclasses
import os

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.long_prompts import Lanes
from batcher.continuous.replica import Replica
from batcher.continuous.router import Router
from batcher.continuous.seat_wait import Arrival, Price, SeatedLoad, seat_wait
from batcher.continuous.ticket import Ticket
from batcher.continuous.token_load import TokenLoad
from batcher.core.admission import AdmissionControl, Load
from batcher.core.backend import Job
from batcher.core.config import QueueConfig
from batcher.core.errors import Shed, TooLarge
from batcher.core.staffing import Staffing
from workers.engine.fit import cost_fit

PREFILL_STEPS = 2
"""Steps' worth of prompt an engine is given ahead: the next step's chunk is already there while
this one runs (with one, every other step of a burst would wait for the frames of the next)."""


def blocks(tokens: int, block_size: int) -> int:
    """The KV blocks that hold ``tokens`` tokens (the engine's own count: a partly full block is one)."""
    return -(-tokens // block_size)


def step_price(config: ContinuousModelConfig) -> Price | None:
    """The engines' price of a decode step, from their ``step_costs`` file (None: none)."""
    if not config.step_costs:
        return None
    return cost_fit.load(os.path.expanduser(config.step_costs)).decode_seconds


class Estimates:
    """The pool's placement and estimates over its ``replicas`` (see the module doc).
    ``prompts``: the prompt tokens queued, by lane (ordinary, long) and tier, kept by the pool;
    ``queue``: the pool's queue config, replaced on a retune."""

    def __init__(self, config: ContinuousModelConfig, queue: QueueConfig, replicas: list[Replica],
                 lanes: Lanes, admission: AdmissionControl | None, prompts: list[list[int]],
                 staffing: Staffing) -> None:
        self.config, self.queue, self.replicas, self.lanes = config, queue, replicas, lanes
        self.admission, self.prompts, self.staffing = admission, prompts, staffing
        self.price = step_price(config)

    def long(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` is the long lane's (by its prompt: a resumed stream stays in its lane)."""
        return self.lanes.long_prompt(len(ticket.job.prompt_tokens))

    def candidates(self, ticket: Ticket) -> set[int]:
        """The slots ``ticket`` may be routed to: its lane's (an ordinary one's, else long ones up)."""
        return self.lanes.candidates(self.long(ticket), self.staffing, [r.up for r in self.replicas])

    def route(self, ticket: Ticket, router: Router) -> Replica:
        """The replica ``router`` picks for ``ticket`` among its candidates (a down one only when
        all are down); sets its cost. The pool's router, passed each time: a replay may wrap it."""
        taking = self.candidates(ticket)
        up = any(r.up for r in self.replicas if r.index in taking)
        loads = [r.load if r.index in taking and (r.up or not up) else None for r in self.replicas]
        route = router.choose(loads, ticket.hashes)
        ticket.replica = route.replica
        job = ticket.job
        ticket.cost = len(job.prompt_tokens) - route.held_blocks * self.config.block_size + job.max_tokens
        return self.replicas[route.replica]

    def load(self, long: bool = False) -> TokenLoad:
        """When a queued job of the ordinary (or ``long``) lane would start: the prompt tokens
        queued in the lane per tier, less what its engines take at once (a job is sent while its
        engine has seats, KV and under :data:`PREFILL_STEPS` steps of prompt), against the rate
        at which they prefill: each engine's measured token rate, less the share of its step
        budget its decodes take. Without a long pool the ordinary lane is every replica."""
        lanes = self.lanes
        up = [self.replicas[i] for i in lanes.members(long) if self.replicas[i].up]
        decoding = [(r.stats.running if r.stats else 0) / lanes.budget(r.index) for r in up]
        rate = sum(r.computed.value * max(0.0, 1.0 - share) for r, share in zip(up, decoding, strict=True))
        room = sum(max(0, PREFILL_STEPS * lanes.budget(r.index) - r.prefilling) for r in up
                   if len(r.live) < self.config.max_seqs and r.free_blocks > 0)
        arrivals = self.admission.arrivals(trio.current_time()) if self.admission is not None else ()
        return TokenLoad(tuple(self.prompts[long]), rate, arrivals, room, sum(r.prefilling for r in up))

    def seen_by(self, ticket: Ticket, long: bool) -> Load:
        """The load as ``ticket``'s job sees it: of its tier's queued prompts, the part fair
        shares take before it on each replica of its lane (all of them while one tenant queues),
        and, under a TPOT target, the wait for a seat on its replica."""
        load, tier, tenant = self.load(long), ticket.tier, ticket.tenant
        ahead = sum(self.replicas[i].queue.ahead(tier, tenant) for i in self.lanes.members(long))
        if ahead != load.queued[tier]:
            load = dataclasses.replace(load, queued=(*load.queued[:tier], ahead, *load.queued[tier + 1:]))
        seats = self.seat_wait(ticket)
        return SeatedLoad(load, tier, seats) if seats > 0 else load

    def seat_wait(self, ticket: Ticket) -> float:
        """Seconds until ``ticket`` takes a seat on its replica (:mod:`batcher.continuous.seat_wait`)."""
        targets = self.queue.tpot_targets
        if self.price is None or targets is None:
            return 0.0
        job, weights = ticket.job, self.queue.weights
        r = self.replicas[ticket.replica]
        arrival = Arrival(ticket.tier, ticket.tenant, weights.get(ticket.tenant, 1.0),
                          len(job.prompt_tokens) + job.max_tokens)
        return seat_wait(r.seated, arrival, targets, self.config.max_seqs, self.price, r.generated.value,
                         weights)

    def shed(self, ticket: Ticket, long: bool, now: float) -> Shed | None:
        """Admission's verdict on ``ticket`` (None: admitted); a shed one's Retry-After is never
        sooner than the seat wait that shed it."""
        assert self.admission is not None
        load = self.seen_by(ticket, long)
        error = self.admission.shed(load, ticket.tier, now, ticket.cost, ticket.tenant)
        if error is not None and isinstance(load, SeatedLoad) and load.seats > error.retry_after:
            error = Shed(str(error), load.seats)
        return error

    def retry_after(self, ticket: Ticket, long: bool, now: float) -> float:
        """The Retry-After of ``ticket``, expired in its queue: its tenant's backlog's (1 s
        without admission)."""
        if self.admission is None:
            return 1.0
        return self.admission.retry_after(self.load(long), ticket.tier, now, tenant=ticket.tenant)

    def backlogs(self) -> dict[str, float]:
        """The prompt tokens each tenant has queued, over every replica."""
        work: dict[str, float] = {}
        for r in self.replicas:
            for tenant, tokens in r.queue.backlogs().items():
                work[tenant] = work.get(tenant, 0.0) + tokens
        return work

    def patience(self, tier: int) -> float:
        """How long a job of ``tier`` (with no deadline of its own) may wait in the pool. With
        admission on, its tier's budget is judged once, at arrival: a job the estimate says will
        start within it is admitted and then waits until it starts, up to the queue's timeout
        (the backstop for an estimate gone wrong, an engine that slowed down), rather than fail
        after waiting its whole budget; the rest are shed at once, with their Retry-After."""
        if self.admission is None:
            return self.queue.deadline(tier)
        return max(self.queue.deadline(tier), self.queue.queue_timeout)

    def too_large(self, job: Job) -> TooLarge | None:
        """A job whose prompt and ``max_tokens`` no replica of its lane can hold (None: it fits)."""
        bs = self.config.block_size
        needed = blocks(len(job.prompt_tokens) + job.max_tokens, bs)
        lane = self.lanes.members(self.lanes.long_prompt(len(job.prompt_tokens)))  # the long pool's own size
        capacity = max(self.replicas[i].total_blocks for i in lane)
        if needed <= capacity or not capacity:  # no replica has started yet: none can judge it
            return None
        return TooLarge(
            f"prompt is too long for this model's KV cache: {len(job.prompt_tokens)} prompt tokens + "
            f"max_tokens {job.max_tokens} need {needed} blocks of {bs} tokens; one replica holds "
            f"{capacity} ({capacity * bs} tokens)"
        )
