"""How long a fixed-mode call should take, and how long it may run before its worker counts as hung.

The pool keeps the recent duration of an answered call (an EWMA, 0 until the first answer). The
opening forecast and admission plan with it, and it paces the hang limit. A fleet whose calls are
slow for all of them (a big model, a busy host) must not have every call killed at
``hang_timeout``, so a call may run ``SLOW_CALLS`` recent call times when that is longer. A batch
already killed as hung gets twice as long for each time it was: on a fleet that has just become
slow, no call has been answered at the new pace yet, and the retry of its first batch must be
let finish for the recent call time to learn it. Never more than ``MAX_STRETCH`` hang timeouts:
however slow the fleet, a call that runs that long is hung (docs/fixed-mode.md, "A slow fleet is
not a hung worker"). Pure."""

from __future__ import annotations

SLOW_CALLS = 3.0
"""A call may run this many recent call times before it counts as hung (if over hang_timeout)."""
MAX_STRETCH = 8.0
"""However slow the fleet, a call that runs past this many hang_timeouts is hung."""


class CallTime:
    """The recent call time of one pool, and the hang limits it paces (see the module doc)."""

    __slots__ = ("hang_timeout", "seconds")

    def __init__(self, hang_timeout: float) -> None:
        self.hang_timeout = hang_timeout
        self.seconds = 0.0
        """Recent duration of an answered call (an EWMA; 0 until the first answer)."""

    def answered(self, seconds: float) -> None:
        """A call was answered in full after ``seconds``."""
        self.seconds = seconds if not self.seconds else 0.8 * self.seconds + 0.2 * seconds

    def paced(self) -> float:
        """How long a call of a batch that never hung may run: the hang timeout, or longer for a
        slow fleet."""
        return max(self.hang_timeout, SLOW_CALLS * self.seconds)

    def hang_limit(self, hangs: int) -> float:
        """How long a call of a batch that has hung ``hangs`` times may run."""
        return min(self.paced() * 2**hangs, MAX_STRETCH * self.hang_timeout)
