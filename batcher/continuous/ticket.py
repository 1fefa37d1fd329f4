"""A job routed to an engine replica, and where it stands: what the pool's replicas move between
their queues, their re-runs and their engines' live sets.

A :class:`Ticket`'s :class:`Stage` says where it is; only :class:`~batcher.continuous.replica.Replica`'s
methods move it, so the replica's counts cannot drift from its tickets::

    QUEUED ──taken──> PREFILLING ──first token──> RUNNING ──finished──> ENDED
                          │                          │
                          └──────────────────────────┴─ its engine died, nothing shown yet
                                                        ─> RERUN ──started──> PREFILLING

    from any stage: cancelled, expired, failed, or its answer complete ─> ENDED
"""

from __future__ import annotations

import enum
import math

from batcher.continuous.handoff_phases import HandoffPause
from batcher.continuous.token_stream import Output
from batcher.core.backend import Job


class Stage(enum.Enum):
    """Where a ticket stands (see the module doc)."""

    QUEUED = "queued"  # in its replica's tier queues
    RERUN = "rerun"  # lost with its engine before it showed anything: first in a replica's work
    PREFILLING = "prefilling"  # sent to its engine, no token back yet
    RUNNING = "running"  # its engine is making its tokens
    ENDED = "ended"  # its caller has had its last event, or has gone (its engine may still abort it)


class Ticket:
    """One submitted job and where it stands: what :meth:`EnginePool.submit` returns."""

    __slots__ = (
        "arrival",
        "attempts",
        "cost",
        "deadline",
        "dispatched_at",
        "handoff",
        "hashes",
        "out",
        "prefill",
        "remaining",
        "replica",
        "rerun_due",
        "rid",
        "segment",
        "state",
        "tenant",
        "tier",
    )

    def __init__(self, out: Output, tier: int, arrival: float, deadline: float, hashes: list[bytes]) -> None:
        self.out, self.tier, self.arrival, self.deadline, self.hashes = out, tier, arrival, deadline, hashes
        self.tenant = out.job.tenant
        self.state = Stage.QUEUED
        self.cost = 0  # tokens it adds where it waits: prompt not held by its replica + max_tokens
        self.replica = -1
        self.rid = -1  # its sequence's number in the engine, once sent
        self.dispatched_at = arrival
        self.remaining = 0  # tokens its replica owes it (see the module doc)
        self.attempts = 0  # times an engine died under it
        self.rerun_due = math.inf  # a re-run that no engine takes by then fails
        self.prefill = 0  # tokens its engine computes before its first token (a resumed one's output too)
        self.handoff: HandoffPause | None = None  # its hand-off's times, until all its parts are counted
        self.segment = ""  # the shared-memory segment of its KV handed to a decode replica ("": none)

    @property
    def job(self) -> Job:
        return self.out.job

    @property
    def ended(self) -> bool:
        return self.state is Stage.ENDED

    @property
    def queued(self) -> float:
        """Seconds it waited in the pool before its engine got it."""
        return self.dispatched_at - self.arrival

    @property
    def prompt(self) -> int:
        """Its prompt's tokens its replica must prefill (less the prefix it holds): its work in
        the queues, and what its tenant is charged when it is taken."""
        return self.cost - self.out.job.max_tokens


def prompt_of(ticket: Ticket) -> float:
    return ticket.prompt
