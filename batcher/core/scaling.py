"""The scaler's trio shell: every ``TICK`` it reads a version's signals,
asks the pure :class:`~batcher.core.scaler.Scaler` how many workers should serve, and does the
:func:`~batcher.core.scaler.plan`'s steps on the version's :class:`Elastic` fleet (a mode's pool
behind a small adapter). Each decision that moves is logged with its reason, counted in
``Counters.scale_events`` by direction and cause, and kept for ``/readyz`` (``Staffed.report``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

import trio

from batcher.core.admission import Rate
from batcher.core.config import ScalerConfig
from batcher.core.counters import Counters
from batcher.core.scaler import Decision, Fleet, Scaler, Signals, plan

log = logging.getLogger("ferry.scaler")

TICK = 0.25
"""Seconds between two decisions: a warm worker is promoted at most this long after it is needed."""
RATE_TAU = 2.0
"""Seconds over which the rate of work done is averaged (an exponential decay)."""


class Staffed(Protocol):
    """A mode's pool as the scaler moves its workers."""

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


class Scaling:
    """Runs one version's scaler (see the module doc)."""

    def __init__(self, config: ScalerConfig, fleet: Elastic, counters: Counters, model: str) -> None:
        self.config = config
        self.scaler = Scaler(config)
        self.fleet = fleet
        self.counters = counters
        self.model = model

    def step(self, now: float) -> Decision:
        """One decision and its steps."""
        pool = self.fleet.pool
        current = pool.fleet()
        heading = current.serving + current.starting
        decision = self.scaler.decide(self.fleet.signals(), heading, now, current.starting)
        steps = plan(decision.serving, current, self.config.warm_workers)
        pool.promote(steps.promote)
        pool.start(steps.start)
        pool.retire(steps.retire)
        pool.start(steps.start_warm, warm=True)
        if decision.direction != "hold":
            self.counters.scale_events[(decision.direction, decision.cause)] += 1
            moved = f"{decision.direction} {heading} -> {decision.serving}"
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
        async with trio.open_nursery() as nursery:
            scaling = Scaling(config, elastic(backend), counters(backend), model)
            await nursery.start(scaling.run)
            yield backend
            nursery.cancel_scope.cancel()
