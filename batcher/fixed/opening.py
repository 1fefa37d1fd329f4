"""When each fixed-mode worker takes its next batch: the forecast the batcher and admission read.

A worker that is sent its next batch only once it is idle loses, between every two calls, the hop
from its answer through the gateway's loop to its next frame. With ``dispatch_ahead``, a busy
worker whose call should end (at the recent call time) within ``dispatch_ahead`` may be sent its
next batch while the call runs: the batch waits in the worker's pipe, and its call starts the
moment the one before it ends (docs/fixed-mode.md, "With dispatch_ahead"). What keeps that to the
contract of one call at a time, and first things first, is decided here, in one place:

- at most one batch waits in a pipe: a worker with one waiting takes nothing more ahead;
- a call that has run more than ``dispatch_ahead`` past its expected end takes nothing ahead: it
  may be hung, and a batch in its pipe would wait on it;
- nothing is sent ahead before a call time has been measured, nor while a failed batch waits for
  an idle worker (a retry goes before new batches);
- a leaving worker takes nothing: the pool leaves it out of the forecast.

From these :class:`Openings` answers three questions: how many workers may be sent a batch now
(the flush policy's ``idle_workers``) and which of them a batch framed ahead goes to; when the
next busy worker may take one (the batcher sleeps until then rather than polling); and how soon
each worker takes a batch (``free_in``, what admission plans its waits and Retry-Afters with: a
request leaves the queue when its batch is framed, not when its call starts, so a busy worker
counts as free ``dispatch_ahead`` before its call should end).

Pure: a view of the live workers at one moment, which :meth:`~batcher.fixed.pool.WorkerPool.openings`
takes for each decision and which is read at once (it reads the pool's slots as they are)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Protocol


class Busy(Protocol):
    """A worker in a call, as the forecast reads it (the pool's :class:`~batcher.fixed.slot.Slot`)."""

    @property
    def busy_since(self) -> float:
        """When its call started: when it was sent to an idle worker, or when the call it waited
        behind ended."""

    @property
    def ahead(self) -> object | None:
        """The batch waiting in its pipe to run after the call, if any."""


@dataclasses.dataclass(frozen=True, slots=True)
class Openings:
    """The forecast over the live workers (up, and not leaving), as they are (see the module doc)."""

    idle: int
    """Idle workers waiting for a batch."""
    live: Mapping[int, Busy | None]
    """Each live worker by slot index, in slot order: the worker while in a call, None while idle."""
    call_seconds: float
    """The recent duration of an answered call (0 until the first answer)."""
    dispatch_ahead: float
    """How near the end of its call a busy worker may be sent its next batch (0: never)."""
    retrying: bool
    """Whether a failed batch waits for an idle worker: until one takes it, nothing is sent ahead."""

    def takers(self, now: float) -> int:
        """Workers that may be sent a batch now: the idle ones, and those whose call ends within
        ``dispatch_ahead`` with no batch waiting to follow it."""
        return self.idle + len(self.ahead_takers(now))

    def ahead_takers(self, now: float) -> list[int]:
        """The busy workers (slot indices) that may be sent a batch ahead now, the one whose call
        should end soonest first (the lowest slot among equals): each call should end within
        ``dispatch_ahead``, and has not run more than that past its expected end."""
        if not self._ahead_allowed():
            return []
        window = 2 * self.dispatch_ahead
        opening = [(opens, index) for index, worker in self._followable()
                   if (opens := self._opens_at(worker)) <= now < opens + window]
        return [index for _, index in sorted(opening)]

    def next_opening(self, now: float) -> float:
        """When the next busy worker comes within ``dispatch_ahead`` of its call's end (inf: none will)."""
        if not self._ahead_allowed():
            return math.inf
        return min((opens for _, worker in self._followable() if (opens := self._opens_at(worker)) > now),
                   default=math.inf)

    def free_in(self, now: float) -> list[float]:
        """Seconds until each live worker can take a batch, in slot order: 0 if idle, else what
        remains of its call at the recent call time (0 once overdue), and of the batch waiting to
        follow it, less ``dispatch_ahead`` where a batch may be sent ahead."""
        seconds = self.call_seconds
        lead = self.dispatch_ahead if self._ahead_allowed() else 0.0
        return [max(0.0, worker.busy_since + seconds * (1 if worker.ahead is None else 2) - lead - now)
                if worker is not None else 0.0 for worker in self.live.values()]

    def _followable(self) -> Iterator[tuple[int, Busy]]:
        """The busy workers with no batch waiting in their pipe yet."""
        return ((index, worker) for index, worker in self.live.items()
                if worker is not None and worker.ahead is None)

    def _ahead_allowed(self) -> bool:
        return self.dispatch_ahead > 0 and self.call_seconds > 0 and not self.retrying

    def _opens_at(self, worker: Busy) -> float:
        """When a worker's call comes within ``dispatch_ahead`` of its expected end."""
        return worker.busy_since + self.call_seconds - self.dispatch_ahead
