"""Overload admission: admit a request only if a worker will take it within its tier's budget.

A burst arrives faster than capacity can grow, so the scheduler says no early and clearly. The
wait follows the fleet's own rhythm (a :class:`BatchLoad`: when each worker next takes a batch,
its size, the call time), and a lower tier's budget shrinks as the tiers above it fill::

    wait(tier)   = first e in {free_in[i] + r x call}  with
                   batch x (batches dispatched by e)  >=  ahead + passing x e + MARGIN x sqrt(passing x e)
    budget(tier) = wait_budget(tier) x product over higher tiers h of max(0, 1 - pressure(h) / wait_budget(h))

Pure. Why not queued work over the drain rate, and what ``Retry-After`` says: docs/admission.md
("Overload"); measured in experiments/docs/burst.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

from batcher.core.errors import Shed

MARGIN = 2.0
"""Standard deviations of higher tiers' Poisson arrivals a lower tier's estimate allows for.

Without it, free requests admitted at the edge are passed by paid ones and expire at their
deadline, and their Retry-After is less often right; what 2 buys in the 3x burst is in
experiments/docs/constants.md."""


class Load(Protocol):
    """What a backend reports about itself, in its own unit of work: requests for the fixed mode,
    tokens for the continuous mode. The overload rule below judges a new job's ``cost`` in
    that unit against the backend's drain rate in the same unit, so one rule serves both."""

    @property
    def queued(self) -> tuple[float, ...]:
        """Work waiting, per tier."""

    @property
    def measured(self) -> bool:
        """False until the backend knows its own speed: until then everything is admitted."""

    @property
    def drain_rate(self) -> float:
        """Work per second the fleet clears while backlogged."""

    def wait(self, tier: int, cost: float = 1.0) -> float:
        """Estimated seconds before a worker takes a new job of ``tier`` and ``cost``."""

    def pressure(self, tier: int) -> float:
        """Seconds by which the queue of ``tier`` and above reaches past what the fleet takes
        next: how much of a wait is backlog rather than the phase of the workers' calls."""


@dataclasses.dataclass(frozen=True, slots=True)
class BatchLoad:
    """The fixed mode's :class:`Load`: its queues and when its workers take their next batch.

    ``free_in`` has one entry per live worker, seconds until it can take a batch (0 when idle);
    ``batch`` is how many requests a call takes and ``call`` how long it lasts (0 until measured:
    then everything is admitted). ``arrivals`` is the recent rate of admitted requests per tier,
    per second. Work is counted in requests: a job costs 1 whatever its size, because a batch
    costs the same at any size.
    """

    queued: tuple[float, ...]
    free_in: tuple[float, ...]
    batch: int
    call: float
    arrivals: tuple[float, ...] = ()

    @property
    def measured(self) -> bool:
        return self.call > 0

    @property
    def drain_rate(self) -> float:
        """Requests per second the fleet clears while backlogged (0: not measured yet)."""
        return len(self.free_in) * self.batch / self.call if self.call > 0 else 0.0

    def wait(self, tier: int, cost: float = 1.0) -> float:
        """Estimated seconds before a worker takes a new request of ``tier`` (see the module doc)."""
        return self.dispatch_in(tier, extra=math.ceil(cost), margin=MARGIN)

    def pressure(self, tier: int) -> float:
        """Seconds by which the queue of ``tier`` and above reaches past the next dispatch: 0
        while the next batches take it all, whatever the phase of the workers' calls."""
        if not self.free_in:
            return 0.0
        return max(0.0, self.dispatch_in(tier, margin=MARGIN) - min(self.free_in))

    def dispatch_in(self, tier: int, extra: int = 0, margin: float = 0.0) -> float:
        """Seconds until the work queued in ``tier`` and above, plus ``extra`` more, has been
        taken by workers while higher tiers' arrivals keep passing it (inf: never)."""
        ahead = sum(self.queued[: tier + 1]) + extra
        if self.call <= 0 or not self.free_in or ahead <= 0:
            return 0.0
        passing = sum(self.arrivals[:tier])
        per_round = self.batch * len(self.free_in)
        net = per_round / self.call - passing  # places per second left to this tier and below
        starts = sorted(self.free_in)
        for index, start in enumerate(starts, 1):  # each worker's next batch
            places = self.batch * index  # in the batches up to and including this worker's next
            if ahead + passing * start + margin * math.sqrt(passing * start) <= places:
                return start  # the first dispatch with room; every later one is later still
        if net <= 0:
            return math.inf  # higher tiers take every place
        noise = margin * math.sqrt(passing)
        best = math.inf
        for index, start in enumerate(starts, 1):
            # this worker's batch r rounds on, at x = start + r x call, has room when
            #   net x x - margin x sqrt(passing x x) >= ahead - places + start x per_round / call,
            # a quadratic in sqrt(x), true from its root on; its batch at the first round at or
            # after that x, the root's rounding then settled by the inequality itself
            short = ahead - self.batch * index + start * per_round / self.call
            root = (noise + math.sqrt(max(0.0, noise * noise + 4 * net * short))) / (2 * net)

            def room(rounds: int, index: int = index, start: float = start) -> bool:
                at = start + rounds * self.call
                places = self.batch * (rounds * len(starts) + index)
                return places >= ahead + passing * at + margin * math.sqrt(passing * at)

            rounds = max(1, math.ceil((root * root - start) / self.call))
            while rounds > 1 and room(rounds - 1):
                rounds -= 1
            while not room(rounds):
                rounds += 1
            best = min(best, start + rounds * self.call)
        return best


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
        allowed *= max(0.0, 1.0 - load.pressure(higher) / budgets[higher])
    return allowed


class Rate:
    """Events per second, decayed exponentially with time constant ``tau``: cheap, and current.

    At a steady rate r it reads r; after a pause it falls back towards 0 within a few ``tau``.
    """

    __slots__ = ("_updated", "_value", "tau")

    def __init__(self, tau: float = 1.0) -> None:
        self.tau = tau
        self._value = 0.0
        self._updated = -math.inf

    def add(self, now: float, amount: float = 1.0) -> None:
        self._value = self.at(now) + amount / self.tau
        self._updated = now

    def at(self, now: float) -> float:
        if now <= self._updated:
            return self._value
        return self._value * math.exp((self._updated - now) / self.tau)


TENANTS_KEPT = 1024
"""Tenants per tier whose newest admitted job's due time is kept; past it, those already due go."""


class AdmissionControl:
    """Judges each arrival at one backend, and remembers what later judgements need: each tier's
    rate of admitted arrivals, and when its newest admitted request is due to be taken, in all
    and by tenant (a tenant's Retry-After is its own backlog's, within its tier)."""

    def __init__(self, budgets: Sequence[float]) -> None:
        self.budgets = tuple(budgets)
        self._arrivals = [Rate() for _ in self.budgets]
        self._due = [-math.inf] * len(self.budgets)
        self._tenant_due: list[dict[str, float]] = [{} for _ in self.budgets]

    def arrivals(self, now: float) -> tuple[float, ...]:
        """Admitted work per second, per tier, as of ``now``: what a :class:`Load` needs."""
        return tuple(rate.at(now) for rate in self._arrivals)

    def judge(self, load: Load, tier: int, now: float, cost: float = 1.0, tenant: str = "") -> Admission:
        """Admit or shed one new job of ``tier`` (0 is the highest), ``cost`` and ``tenant``
        arriving at ``now``; ``load`` as that tenant's job sees it (its tier's work that fair
        shares take before it)."""
        if not 0 <= tier < len(self.budgets) or len(load.queued) != len(self.budgets):
            raise ValueError(f"tier {tier} of {len(self.budgets)} budgets, load for {len(load.queued)} tiers")
        wait = load.wait(tier, cost)
        allowed = budget(load, tier, self.budgets)
        if not load.measured or (wait <= allowed and allowed > 0):
            self._arrivals[tier].add(now, cost)
            self._due[tier] = now + wait
            dues = self._tenant_due[tier]
            if len(dues) >= TENANTS_KEPT and tenant not in dues:
                self._tenant_due[tier] = dues = {name: due for name, due in dues.items() if due > now}
            dues[tenant] = now + wait
            return Admission(True, wait, allowed)
        return Admission(False, wait, allowed, self.retry_after(load, tier, now, cost, tenant))

    def shed(self, load: Load, tier: int, now: float, cost: float = 1.0, tenant: str = "") -> Shed | None:
        """The one shedding rule every backend calls: None to admit the job, else the
        :class:`~batcher.core.errors.Shed` error to fail it with (its ``retry_after`` set)."""
        verdict = self.judge(load, tier, now, cost, tenant)
        if verdict.admitted:
            return None
        if math.isinf(verdict.wait):  # the higher tiers' arrivals take all of the drain
            message = f"no capacity is left for this tier within its budget of {verdict.budget:.3f}s"
        else:
            message = f"estimated wait {verdict.wait:.3f}s is over the budget of {verdict.budget:.3f}s"
        return Shed(message, verdict.retry_after)

    def retry_after(
        self, load: Load, tier: int, now: float, cost: float = 1.0, tenant: str | None = None
    ) -> float:
        """When the work ahead of a job of ``tier`` is due to have left the queue, as predicted
        for the newest of it when it was admitted: of the higher tiers, and of its own tier, or
        of its ``tenant`` in its tier (the backlog its own share implies); never less than the
        job's own share of the fleet's drain rate."""
        own = self._due[tier] if tenant is None else self._tenant_due[tier].get(tenant, -math.inf)
        due = max([*self._due[:tier], own]) - now
        rate = load.drain_rate
        return max(due, cost / rate if rate > 0 else 1.0)
