"""The scaler's trio shell: every ``TICK`` it reads a version's signals,
asks the pure :class:`~batcher.core.scaler.Scaler` how many workers should serve, and does the
:func:`~batcher.core.scaler.plan`'s steps on the version's :class:`Elastic` fleet (a mode's pool
behind a small adapter). Each decision that moves is logged with its reason, counted in
``Counters.scale_events`` by direction and cause, and kept for ``/readyz`` (``Staffed.report``).

A version in a shared pool (``pool = "rare"``) starts a worker only on a slot its :class:`Lease`
claims from the pool (:mod:`batcher.core.shared_pool`); a claim may evict the member idle
longest. The pools are kept by name for the process: every version that names one shares it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

import trio

from batcher.core.admission import Rate
from batcher.core.config import ScalerConfig
from batcher.core.counters import Counters
from batcher.core.scaler import Decision, Fleet, Scaler, Signals, plan
from batcher.core.shared_pool import SharedPool
from batcher.core.staffing import Staffing

log = logging.getLogger("ferry.scaler")

TICK = 0.25
"""Seconds between two decisions: a warm worker is promoted at most this long after it is needed."""
RATE_TAU = 2.0
"""Seconds over which the rate of work done is averaged (an exponential decay)."""


class Staffed(Protocol):
    """A mode's pool as the scaler moves its workers."""

    @property
    def staffing(self) -> Staffing:
        """Which of its slots are staffed (a shared pool counts them as held)."""

    def fleet(self) -> Fleet:
        """Its workers by role."""

    def start(self, count: int, warm: bool = False) -> None:
        """Start up to ``count`` workers, to serve or to be kept warm."""

    def promote(self, count: int) -> None:
        """Up to ``count`` warm workers serve from now on."""

    def retire(self, count: int) -> None:
        """Take ``count`` serving workers away: busy ones drain, then stop."""

    def report(self, decision: str) -> None:
        """The last decision that moved, as ``/readyz`` shows it."""


class Elastic(Protocol):
    """A version as the scaler sees it: the signals it decides by, and the pool it moves."""

    @property
    def pool(self) -> Staffed:
        """The version's pool."""

    def signals(self) -> Signals:
        """The version's signals now (:class:`~batcher.core.scaler.Signals`)."""


class Throughput:
    """Work per second from a counter that only grows (requests flushed, tokens computed)."""

    def __init__(self) -> None:
        self._rate = Rate(RATE_TAU)
        self._seen: float | None = None

    def at(self, now: float, done: float) -> float:
        if self._seen is not None and done > self._seen:
            self._rate.add(now, done - self._seen)
        self._seen = done
        return self._rate.at(now)


class Lease:
    """A version's place in a shared pool: it reports the version's slots and work at each tick,
    claims a slot for each worker the scaler would start, and evicts the members a claim names
    (their workers retired: an idle one stops at once, a busy one drains first)."""

    def __init__(self, shared: SharedPool, members: dict[str, tuple[Staffed, Counters]], model: str) -> None:
        self.shared = shared
        self.members = members  # every version in the pool: its pool, and its counters
        self.model = model

    def claim(self, start: int, held: int, working: bool, now: float) -> int:
        """Of ``start`` workers wanted, how many may start now (one per slot granted)."""
        self.shared.seen(self.model, held, working, now)
        if not start:
            return 0
        claim = self.shared.claim(self.model, start)
        for victim in claim.evict:
            pool, counters = self.members[victim]
            fleet = pool.fleet()
            pool.retire(fleet.serving + fleet.starting)
            counters.scale_events[("down", "evicted")] += 1
            line = (f"down {fleet.serving + fleet.starting} -> 0 (evicted): pool {self.shared.name!r}'s "
                    f"slot goes to {self.model}, which has work")
            log.info("%s: scaling %s", victim, line)
            pool.report(line)
        return claim.granted


_SHARED: dict[str, tuple[SharedPool, dict[str, tuple[Staffed, Counters]]]] = {}
"""The shared pools of this process by name, each with its member versions."""


@contextlib.contextmanager
def leased(config: ScalerConfig, pool: Staffed, counters: Counters, model: str) -> Iterator[Lease | None]:
    """The version's :class:`Lease` on its shared pool while it is open (None outside any):
    the pool is made by its first member, takes the slot count a reload gives, and goes with
    its last member."""
    if not config.pool:
        yield None
        return
    shared, members = _SHARED.setdefault(config.pool, (SharedPool(config.pool, config.pool_slots), {}))
    shared.slots = config.pool_slots
    shared.join(model)
    members[model] = (pool, counters)
    try:
        yield Lease(shared, members, model)
    finally:
        shared.leave(model)
        del members[model]
        if not members:
            del _SHARED[config.pool]


class Scaling:
    """Runs one version's scaler (see the module doc)."""

    def __init__(self, config: ScalerConfig, fleet: Elastic, counters: Counters, model: str,
                 lease: Lease | None = None) -> None:
        self.config = config
        self.scaler = Scaler(config)
        self.fleet = fleet
        self.counters = counters
        self.model = model
        self.lease = lease

    def step(self, now: float) -> Decision:
        """One decision and its steps; in a shared pool, only the starts its slots allow."""
        pool = self.fleet.pool
        current = pool.fleet()
        heading = current.serving + current.starting
        signals = self.fleet.signals()
        decision = self.scaler.decide(signals, heading, now, current.starting)
        steps = plan(decision.serving, current, self.config.warm_workers)
        start = steps.start
        if self.lease is not None:
            working = signals.queued > 0 or signals.busy > 0 or current.starting > 0
            start = self.lease.claim(start, pool.staffing.staffed, working, now)
        pool.promote(steps.promote)
        pool.start(start)
        pool.retire(steps.retire)
        pool.start(steps.start_warm, warm=True)
        if start < steps.start and not (start or steps.promote):  # nothing moved: every slot is held
            pool.report(f"waiting for a slot of pool {self.config.pool!r}: every slot is held")
        elif decision.direction != "hold":
            self.counters.scale_events[(decision.direction, decision.cause)] += 1
            moved = f"{decision.direction} {heading} -> {heading + start + steps.promote - steps.retire}"
            line = f"{moved} ({decision.cause}): {decision.reason}"
            log.info("%s: scaling %s", self.model, line)
            pool.report(line)
        return decision

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.step(trio.current_time())
            await trio.sleep(TICK)


B = TypeVar("B")


@contextlib.asynccontextmanager
async def open_scaled(opened: AbstractAsyncContextManager[B], config: ScalerConfig,
                      elastic: Callable[[B], Elastic], counters: Callable[[B], Counters], model: str
                      ) -> AsyncIterator[B]:
    """A mode's backend, ``opened``, with its scaler running while the context is open if
    ``config`` has anything to scale; ``elastic`` makes the backend's :class:`Elastic`."""
    async with opened as backend:
        if not config.elastic:
            yield backend
            return
        fleet = elastic(backend)
        with leased(config, fleet.pool, counters(backend), model) as lease:
            async with trio.open_nursery() as nursery:
                await nursery.start(Scaling(config, fleet, counters(backend), model, lease).run)
                yield backend
                nursery.cancel_scope.cancel()
