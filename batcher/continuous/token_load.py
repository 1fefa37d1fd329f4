"""The continuous mode's :class:`~batcher.core.admission.Load`: when a queued request would
*start*, in tokens against a measured token rate (the fluid estimate). Pure.

A request starts once the prompts ahead of it have been prefilled: at once if the prompt tokens
queued in its tier and above fit the engines' ``room`` (seats, KV blocks, under two steps'
budget of prompt not yet prefilled), else when they and the prompts the engines hold have been
computed, while the higher tiers' arrivals keep passing it::

    wait(t) = (sum(queued[0..t]) + prefilling) / (rate - sum(arrivals[0..t-1]))   (0 within room)

``rate`` is the tokens the engines compute per second while backlogged, from their ``stats``,
less their decodes' share; until a backlog has been seen, everything is admitted."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLoad:
    """Queued tokens per tier, the fleet's token rate, and admitted tokens per second per tier."""

    queued: tuple[float, ...]
    rate: float  # tokens/s the fleet computes while busy; 0 until measured
    arrivals: tuple[float, ...] = ()
    room: float = 0.0  # queued tokens the engines take at once, highest tier first
    prefilling: float = 0.0  # tokens the engines have been sent and not yet computed

    @property
    def measured(self) -> bool:
        return self.rate > 0

    @property
    def drain_rate(self) -> float:
        return self.rate

    def wait(self, tier: int, cost: float = 0.0) -> float:
        """Seconds until the work queued in ``tier`` and above has been computed, at the rate the
        higher tiers' arrivals leave to it. A job's own ``cost`` is what it adds for the jobs
        behind it, not part of its own wait (it starts before its own tokens are computed)."""
        ahead = sum(self.queued[: tier + 1])
        if ahead < self.room or self.rate <= 0:  # the engines take it at once
            return 0.0
        net = self.rate - sum(self.arrivals[:tier])
        return (ahead + self.prefilling) / net if net > 0 else math.inf

    def pressure(self, tier: int) -> float:
        return self.wait(tier)


class TokenRate:
    """A token counter's rate per second, an exponential average over the intervals between
    readings, ``tau`` seconds long in memory. Readings of a busy engine only, when ``busy`` says
    so: then it measures what the engine can do, not how little it was asked."""

    __slots__ = ("_last", "tau", "value")

    def __init__(self, tau: float = 2.0) -> None:
        self.tau = tau
        self.value = 0.0
        self._last: tuple[float, int] | None = None

    def update(self, now: float, count: int, busy: bool = True) -> None:
        """A reading of the counter at ``now``; ``busy``: the engine had work all interval."""
        last, self._last = self._last, (now, count)
        if last is None or now <= last[0] or count < last[1] or not busy:
            return
        rate = (count - last[1]) / (now - last[0])
        weight = 1.0 - math.exp((last[0] - now) / self.tau)
        self.value = rate if self.value == 0.0 else self.value + weight * (rate - self.value)

    def restart(self) -> None:
        """The counter starts again from 0 (a new engine process); the rate so far is kept."""
        self._last = None
