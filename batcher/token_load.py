"""The continuous mode's :class:`~batcher.admission.Load`: work in tokens against a measured token
rate (the fluid estimate: "queued tokens / recent throughput"). Pure.

A request's cost is the tokens the fleet must still compute for it: its prompt less the prefix
its replica already holds, plus its ``max_tokens`` (one token computed per output token). The
engine pool keeps each tier's queue on the gateway side and hands a replica only what it can
start within about two steps, so the queued work is exactly the work that has not started; a new
request of tier ``t`` waits, roughly, until the fleet has computed what is queued in ``t`` and
above, while the higher tiers' new arrivals keep passing it::

    wait(t)     = sum(queued[0..t]) / (rate - sum(arrivals[0..t-1]))      (inf when <= 0)
    pressure(t) = wait(t): everything queued is backlog, since a replica with room takes at once

``rate`` is tokens computed per second while the engines are backlogged (prompt chunks and
decodes alike), measured from their ``stats`` frames by :class:`TokenRate`: a saturated engine's
throughput is its capacity. Until a backlog has been seen there is nothing to measure, and
nothing waits, so everything is admitted. KV memory enters through the queue: a replica whose
cache is full takes nothing, so its requests wait in the pool, and the wait grows.

The estimate is the plain fluid one and errs on the side of shedding: a queued request starts
when the one ahead of it has *started*, which under continuous batching is sooner than when the
work ahead has been computed, unless the engines are full (``max_seqs`` or KV), which is when
the estimate matters.

Deliberately simpler than the fixed mode's :class:`~batcher.admission.BatchLoad`: a continuous
engine admits work every step (a few ms on a GPU), so there is no batch phase to predict.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLoad:
    """Queued tokens per tier, the fleet's token rate, and admitted tokens per second per tier."""

    queued: tuple[float, ...]
    rate: float  # tokens/s the fleet computes while busy; 0 until measured
    arrivals: tuple[float, ...] = ()

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
        if ahead <= 0 or self.rate <= 0:
            return 0.0
        net = self.rate - sum(self.arrivals[:tier])
        return ahead / net if net > 0 else math.inf

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
