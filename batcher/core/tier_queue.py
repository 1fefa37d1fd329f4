"""Per-tier queues: paid first, free fills the spare slots, aging keeps free moving; inside a
tier, tenants by weighted fair shares (:mod:`workers.shares`: one tenant alone is plain FIFO).

Pure and synchronous: the caller's trio loop asks it questions (how many wait, since when, which
deadline comes next, how much is ahead of a tenant) and takes from it; time is passed in. It
queues anything :class:`Queued` (a ``tier``, a ``tenant``, an ``arrival``, a ``deadline``, a
``state``): the fixed mode's requests, the continuous pool's tickets. Removal is lazy but
counting is not: a cancelled or expired item stays in its FIFO until it reaches the front, but
:attr:`TierQueues.count` drops at once. Aging: under sustained overload paid traffic alone could
fill every batch, so a lower-tier item older than ``age_limit`` may take up to ``aged_share`` of
the slots dispatched over time (a credit per batch, so the share holds for batches of 1 as of 50).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from workers.shares import FairQueue

S = TypeVar("S", bound=enum.Enum)


class Queued(Protocol[S]):
    """What the queues hold: its tier (0 is served first), its tenant, when it arrived, the
    latest time it may leave the queue, and its state (live while it is the queue's waiting
    state), a value of its owner's own enum ``S``."""

    tier: int
    tenant: str
    arrival: float
    deadline: float
    state: S


T = TypeVar("T", bound=Queued[Any])  # any owner's enum: the queues only compare and set states


class TierQueues(Generic[T]):
    """The queues of every tier (see the module doc); ``waiting`` and ``taken`` are the states
    of an item in the queue and of one taken out of it. ``weights`` are the tenants' (1 for one
    not named); ``cost`` is an item's work, what its tenant is charged when it is taken (None: 1
    an item, the fixed mode's requests)."""

    def __init__(self, tiers: int, age_limit: float = math.inf, aged_share: float = 0.0, *,
                 waiting: enum.Enum, taken: enum.Enum, weights: Mapping[str, float] | None = None,
                 cost: Callable[[T], float] | None = None) -> None:
        if tiers < 1:
            raise ValueError(f"tiers: expected at least one, got {tiers}")
        if not 0.0 <= aged_share <= 1.0:
            raise ValueError(f"aged_share: expected 0..1, got {aged_share}")

        def live(item: T) -> bool:
            return item.state is waiting

        weights = weights or {}
        tenant = operator.attrgetter("tenant")
        self._queues: list[FairQueue[T]] = [FairQueue(weights, tenant, live, cost) for _ in range(tiers)]
        self._deadlines: list[tuple[float, int, T]] = []
        self._waiting, self._taken = waiting, taken
        self._order = itertools.count()
        self._age_limit = age_limit
        self._aged_share = aged_share
        self._aged_credit = 0.0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def queued(self, tier: int) -> int:
        """Live items waiting in one tier."""
        return self._queues[tier].count

    def ahead(self, tier: int, tenant: str) -> float:
        """The work of ``tier`` that its fair shares take before a new item of ``tenant``: all of
        it while one tenant queues (:meth:`workers.shares.FairQueue.ahead`)."""
        return self._queues[tier].ahead(tenant)

    def charge(self, tier: int, tenant: str, cost: float) -> None:
        """``tenant`` was given ``cost`` more work in ``tier`` after its item was taken (an
        engine's answer tokens as they are made)."""
        self._queues[tier].charge(tenant, cost)

    def backlogs(self) -> dict[str, float]:
        """The work each tenant has waiting, over every tier."""
        work: dict[str, float] = {}
        for queue in self._queues:
            for tenant, backlog in queue.backlogs():
                work[tenant] = work.get(tenant, 0.0) + backlog
        return work

    def reweigh(self, weights: Mapping[str, float]) -> None:
        """The tenants' new weights (a reload), for their service from now on."""
        for queue in self._queues:
            queue.reweigh(weights)

    def push(self, request: T) -> None:
        """Queue an item at the back of its tenant's FIFO in its tier."""
        if request.state is not self._waiting:
            raise ValueError(f"cannot queue an item that is {request.state.value}, not {self._waiting.value}")
        self._queues[request.tier].push(request)
        self.count += 1
        if request.deadline < math.inf:
            heapq.heappush(self._deadlines, (request.deadline, next(self._order), request))

    def discard(self, request: T) -> None:
        """Forget an item that has left the queue (cancelled); its slot is freed at once."""
        if request.state is self._waiting:
            raise ValueError(f"an item must leave the {self._waiting.name} state before discard")
        self._queues[request.tier].forget(request)
        self.count -= 1

    def oldest_arrival(self) -> float | None:
        """Arrival time of the oldest live request of any tier, or None when all are empty."""
        fronts = [front.arrival for queue in self._queues for front in queue.fronts()]
        return min(fronts, default=None)

    def next_deadline(self) -> float:
        """The earliest deadline of a live request (inf when there is none)."""
        heap = self._deadlines
        while heap and heap[0][2].state is not self._waiting:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def expire(self, now: float) -> list[T]:
        """Take out every live item whose deadline has passed.

        They leave the count at once but are still waiting: the caller must end each of them
        (``request.fail(Overloaded(...))``) before it next uses the queues.
        """
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if request.state is self._waiting:  # still counted: take it out of the count
                self._queues[request.tier].forget(request)
                self.count -= 1
                expired.append(request)
        return expired

    def take(self, size: int, now: float) -> list[T]:
        """Up to ``size`` items: aged ones within their share, then tier by tier, each tier's by
        its tenants' fair shares (oldest first within a tenant).

        Taken items are put in the ``taken`` state.
        """
        batch: list[T] = []
        if self._aged_share > 0 and len(self._queues) > 1:
            self._aged_credit = min(self._aged_credit + self._aged_share * size, float(size))
            if not self.count:  # what _take_aged makes of empty queues, without looking at them
                self._aged_credit = 0.0 if self._aged_credit >= 1.0 else self._aged_credit
                return batch
            self._take_aged(batch, now)
        for tier in range(len(self._queues)):
            while len(batch) < size and self._front(tier) is not None:
                self._pop(tier, batch)
        return batch

    def _take_aged(self, batch: list[T], now: float) -> None:
        """Move aged lower-tier requests into ``batch`` while the aged credit lasts, oldest first."""
        cutoff = now - self._age_limit
        while self._aged_credit >= 1.0:
            candidates = [
                (front.arrival, tier)
                for tier in range(1, len(self._queues))
                if (front := self._front(tier)) and front.arrival <= cutoff
            ]
            if not candidates:  # nothing aged: bank no credit for later bursts
                self._aged_credit = 0.0
                return
            self._pop(min(candidates)[1], batch)
            self._aged_credit -= 1.0

    def _front(self, tier: int) -> T | None:
        return self._queues[tier].front()

    def _pop(self, tier: int, batch: list[T]) -> None:
        request = self._queues[tier].pop()
        request.state = self._taken
        self.count -= 1
        batch.append(request)
