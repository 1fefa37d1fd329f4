"""Overload admission: admit a request only if its estimated wait fits its tier's budget.

Seed 000 §5.6, §6.2: a burst arrives faster than capacity can grow, so the scheduler must say
no early and clearly rather than let every queue grow. The estimate is fluid and cheap: the work
queued ahead of a new request divided by the rate the backend drains work while backlogged.

    wait(tier)   = (work queued in this tier and every tier above it) / drain_rate
    budget(tier) = wait_budget(tier) x  product over higher tiers h of  max(0, 1 - wait(h) / wait_budget(h))

The product is the tiering: as the paid queue fills its own budget, the free budget shrinks in
proportion and reaches zero when paid's wait reaches paid's budget, so free traffic is shed first
and paid is touched only when paid alone overloads the fleet. A refusal carries ``retry_after``:
how long the work now ahead of the request takes to drain at the measured rate, which is when
a retry would find that queue gone.

Pure: the trio shell passes a :class:`Load` snapshot in and acts on the :class:`Admission`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """What a backend reports about itself: queued work per tier and how fast it drains.

    Work is counted in the backend's own unit (requests for fixed batches, tokens for
    continuous batching); ``drain_rate`` is that unit per second while backlogged, 0 when the
    backend has not measured it yet (then everything is admitted).
    """

    queued: tuple[int, ...]
    drain_rate: float

    def wait(self, tier: int) -> float:
        """Seconds until the work queued in ``tier`` and above has drained."""
        if self.drain_rate <= 0:
            return 0.0
        return sum(self.queued[: tier + 1]) / self.drain_rate


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The verdict on one new request: admitted, or shed with when to come back."""

    admitted: bool
    wait: float  # estimated seconds before a worker takes it
    budget: float  # the tier's budget after higher tiers' pressure
    retry_after: float = 0.0  # seconds, when shed


def budget(load: Load, tier: int, budgets: Sequence[float]) -> float:
    """A tier's wait budget, shrunk by the pressure on every tier above it."""
    allowed = budgets[tier]
    for higher in range(tier):
        allowed *= max(0.0, 1.0 - load.wait(higher) / budgets[higher])
    return allowed


def admit(load: Load, tier: int, budgets: Sequence[float]) -> Admission:
    """Admit or shed one new request of ``tier`` (0 is the highest) given the backend's load."""
    if not 0 <= tier < len(budgets) or len(load.queued) != len(budgets):
        raise ValueError(f"tier {tier} of {len(budgets)} budgets, load for {len(load.queued)} tiers")
    wait = load.wait(tier)
    allowed = budget(load, tier, budgets)
    if wait <= allowed and allowed > 0:
        return Admission(True, wait, allowed)
    return Admission(False, wait, allowed, retry_after=max(wait, 1.0 / load.drain_rate))
