"""Per-tier FIFO queues: paid first, free fills the spare slots, aging keeps free moving.

Pure and synchronous: the caller's trio loop asks it questions (how many wait, since when, which
deadline comes next) and takes from it; time is passed in. It queues anything :class:`Queued`
(a ``tier``, an ``arrival``, a ``deadline``, a ``state``): the fixed mode's requests, the
continuous pool's tickets. Removal is lazy but counting is not: a cancelled or expired item
stays in its deque until it reaches the front, but :attr:`TierQueues.count` drops at once.
Aging: under sustained overload paid traffic alone could fill every batch, so a lower-tier item
older than ``age_limit`` may take up to ``aged_share`` of the slots dispatched over time (a
credit per batch, so the share holds for batches of 1 as of 50).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import deque
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S", bound=enum.Enum)


class Queued(Protocol[S]):
    """What the queues hold: its tier (0 is served first), when it arrived, the latest time it
    may leave the queue, and its state (live while it is the queue's waiting state), a value of
    its owner's own enum ``S``."""

    tier: int
    arrival: float
    deadline: float
    state: S


T = TypeVar("T", bound=Queued[Any])  # any owner's enum: the queues only compare and set states


class TierQueues(Generic[T]):
    """The queues of every tier (see the module doc); ``waiting`` and ``taken`` are the states
    of an item in the queue and of one taken out of it."""

    def __init__(self, tiers: int, age_limit: float = math.inf, aged_share: float = 0.0, *,
                 waiting: enum.Enum, taken: enum.Enum) -> None:
        if tiers < 1:
            raise ValueError(f"tiers: expected at least one, got {tiers}")
        if not 0.0 <= aged_share <= 1.0:
            raise ValueError(f"aged_share: expected 0..1, got {aged_share}")
        self._queues: list[deque[T]] = [deque() for _ in range(tiers)]
        self._live = [0] * tiers
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
        return self._live[tier]

    def push(self, request: T) -> None:
        """Queue an item at the back of its tier."""
        if request.state is not self._waiting:
            raise ValueError(f"cannot queue an item that is {request.state.value}, not {self._waiting.value}")
        self._queues[request.tier].append(request)
        self._live[request.tier] += 1
        self.count += 1
        if request.deadline < math.inf:
            heapq.heappush(self._deadlines, (request.deadline, next(self._order), request))

    def discard(self, request: T) -> None:
        """Forget an item that has left the queue (cancelled); its slot is freed at once."""
        if request.state is self._waiting:
            raise ValueError(f"an item must leave the {self._waiting.name} state before discard")
        self._live[request.tier] -= 1
        self.count -= 1

    def oldest_arrival(self) -> float | None:
        """Arrival time of the oldest live request of any tier, or None when all are empty."""
        fronts = [front.arrival for tier in range(len(self._queues)) if (front := self._front(tier))]
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
                self._live[request.tier] -= 1
                self.count -= 1
                expired.append(request)
        return expired

    def take(self, size: int, now: float) -> list[T]:
        """Up to ``size`` items: aged ones within their share, then tier by tier, oldest first.

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
        queue, waiting = self._queues[tier], self._waiting
        while queue and queue[0].state is not waiting:
            queue.popleft()
        return queue[0] if queue else None

    def _pop(self, tier: int, batch: list[T]) -> None:
        request = self._queues[tier].popleft()
        request.state = self._taken
        self._live[tier] -= 1
        self.count -= 1
        batch.append(request)
