"""Which worker slots of a pool that scales are staffed, and how long a start takes (both modes).

A slot is stopped (no worker: the scaler may start one), starting, up, warm (up, sent nothing
until the scaler promotes it), or leaving (no new work is sent to it; it stops once it holds
none). The continuous mode's long-prompt pool's slots (:mod:`batcher.continuous.long_prompts`)
come after the scaler's, ``fixed``: always staffed, never taking ordinary work, never started
nor retired by the scaler. A request that finds no worker up waits for one if the measured start
time (spawn to ``ready`` of the last worker the scaler started) fits its tier's wait budget, else
it is refused with the time to ready as its ``Retry-After`` (:func:`batcher.core.scaler.cold_start`),
and the scaler starts one all the same. Pure bookkeeping; the mode's pool acts on it."""

from __future__ import annotations

from batcher.core.errors import Starting
from batcher.core.scaler import cold_start


class Staffing:
    """The slots of one pool (see the module doc)."""

    def __init__(self, slots: int, initial: int, fixed: int = 0) -> None:
        self.stopped = set(range(initial, slots))
        self.fixed = set(range(slots, slots + fixed))  # the long pool's: outside the scaler's reach
        self.leaving: set[int] = set()
        self.warm: set[int] = set()  # staffed, but routed nothing until promoted
        self.start_seconds = 0.0  # the last measured start: 0 until one was measured
        self.scaling = ""  # what the scaler last decided, and why (/readyz)
        self.refused = False  # a request was refused for want of a replica since the scaler last looked
        self._slots = slots + fixed
        self._starting_at: dict[int, float] = {}

    @property
    def staffed(self) -> int:
        return self._slots - len(self.stopped)

    def taking(self) -> set[int]:
        """The slots a new job may be routed to (by the continuous mode's router): staffed, not
        warm and not leaving; else (none is) a warm one, which the scaler promotes at its next
        tick, or the slot it starts next. Never a fixed slot."""
        taking = set(range(self._slots)) - self.stopped - self.leaving - self.warm - self.fixed
        return taking or set(sorted(self.warm)[:1]) or {min(self.stopped, default=0)}

    def next_stopped(self, count: int) -> list[int]:
        """The ``count`` stopped slots the scaler starts first (the lowest)."""
        return sorted(self.stopped)[:count]

    def started(self, slot: int, now: float, warm: bool = False) -> None:
        self.stopped.discard(slot)
        self._starting_at[slot] = now
        if warm:
            self.warm.add(slot)

    def ready(self, slot: int, now: float) -> None:
        """``slot``'s engine said ready: a start the scaler made is measured."""
        since = self._starting_at.pop(slot, None)
        if since is not None:
            self.start_seconds = now - since

    def drained(self, slot: int, holding: bool) -> bool:
        """Whether a leaving slot may stop now: it holds no job, queued or running."""
        return slot in self.leaving and not holding

    def retired(self, slot: int) -> None:
        self.stopped.add(slot)
        self.leaving.discard(slot)
        self.warm.discard(slot)
        self._starting_at.pop(slot, None)

    def cold(self, now: float, budget: float) -> Starting | None:
        """A request with ``budget`` seconds to wait that finds no replica up: None to let it
        wait for the one starting, else the error that says when one will be ready."""
        if not self.start_seconds:
            return None  # no start measured yet: it waits, and the start is measured
        since = min(self._starting_at.values(), default=now)
        verdict = cold_start(self.start_seconds, now - since, budget)
        if verdict.wait:
            return None
        self.refused = True
        return Starting(f"no worker of this model is up; one is expected to be ready in "
                        f"{verdict.ready_in:.1f}s, past this request's wait budget of {budget:g}s",
                        verdict.ready_in)
