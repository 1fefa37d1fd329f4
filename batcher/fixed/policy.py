"""Flush policies: when the waiting requests leave as a batch, and how many of them.

A policy is a small pure object: shown a :class:`QueueState`, it answers :class:`Flush` (take up
to ``size`` now, for ``reason``) or :class:`Hold` (ask again at ``until``, once ``queued``
requests wait, or when a worker comes free), so the batcher sleeps instead of re-deciding at
every arrival. ``no_batching``, ``static``, ``size_or_timeout`` (the default), ``idle_aware``,
``slack_driven`` and ``aimd`` are built by name (:func:`make_policy`; what each does:
docs/simulation.md; compared in experiments/docs/policies.md). Two optional hooks beside
``decide``: ``drop_before`` (give up at once on a request whose deadline is nearer) and
``observe(size, seconds)`` (every worker call, for policies that learn from them).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True, slots=True)
class QueueState:
    """What a policy may look at: the time, the queue, and the workers free to take a batch.

    ``next_deadline`` is the earliest deadline of a queued request (inf when none has one).
    """

    now: float
    queued: int
    oldest_arrival: float | None
    idle_workers: int
    next_deadline: float = math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class Flush:
    """Dispatch up to ``size`` requests now; ``reason`` is counted ("size", "timeout", ...)."""

    size: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Hold:
    """Wait: decide again at ``until``, when ``queued`` requests wait, or when a worker frees."""

    until: float = math.inf
    queued: int = sys.maxsize


class Policy(Protocol):
    """What the batcher asks before every flush."""

    def decide(self, state: QueueState) -> Flush | Hold: ...


def _check(ok: bool, field: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")


def _check_batch(max_batch: int) -> None:
    _check(isinstance(max_batch, int) and 1 <= max_batch <= 1024, "max_batch", "1..1024", max_batch)


def _check_seconds(field: str, value: float) -> None:
    _check(0.0 <= value < math.inf, field, "a finite number of seconds >= 0", value)


def size_or_timeout(state: QueueState, max_batch: int, max_wait: float) -> Flush | Hold:
    """The size-or-timeout rule, shared by the policies built on it (see :class:`SizeOrTimeout`)."""
    if state.oldest_arrival is None:
        return Hold(queued=1)
    if state.queued >= max_batch:
        reason = "size"
    elif state.now >= state.oldest_arrival + max_wait:
        reason = "timeout"
    elif state.idle_workers:
        return Hold(until=state.oldest_arrival + max_wait, queued=max_batch)
    else:
        return Hold()
    if not state.idle_workers:
        return Hold()
    return Flush(min(state.queued, max_batch), reason)


@dataclasses.dataclass(frozen=True, slots=True)
class SizeOrTimeout:
    """The default policy: flush when ``max_batch`` wait or the oldest has waited ``max_wait``.

    Whichever comes first, and only when a worker is idle to take the batch: with every worker
    busy the requests keep collecting, and the next worker to free up takes a full batch.
    """

    max_batch: int = 50
    max_wait: float = 0.150

    def __post_init__(self) -> None:
        _check_batch(self.max_batch)
        _check_seconds("max_wait", self.max_wait)

    def decide(self, state: QueueState) -> Flush | Hold:
        return size_or_timeout(state, self.max_batch, self.max_wait)


@dataclasses.dataclass(frozen=True, slots=True)
class Static:
    """Wait for a full batch of ``max_batch``, however long: the textbook static batcher.

    At low load its requests wait until enough others arrive (or their deadline passes): the
    baseline that shows why a timeout exists at all.
    """

    max_batch: int = 50

    def __post_init__(self) -> None:
        _check_batch(self.max_batch)

    def decide(self, state: QueueState) -> Flush | Hold:
        if state.queued < self.max_batch:
            return Hold(queued=self.max_batch)
        return Flush(self.max_batch, "size") if state.idle_workers else Hold()


@dataclasses.dataclass(frozen=True, slots=True)
class NoBatching:
    """One request per call, dispatched the moment a worker is idle: batch size 1.

    The lowest latency at zero load and a fiftieth of the capacity of full batches.
    """

    def decide(self, state: QueueState) -> Flush | Hold:
        if not state.queued:
            return Hold(queued=1)
        return Flush(1, "size") if state.idle_workers else Hold()


@dataclasses.dataclass(frozen=True, slots=True)
class IdleAware:
    """:class:`SizeOrTimeout` that never holds requests while spare workers sit idle.

    A batch costs the same at any size, so a batch of 3 now beats a batch of 50 in 150 ms when
    6 GPUs are free. It flushes whatever waits (reason "idle") while more than ``reserve``
    workers are idle, and only waits for size or ``max_wait`` when dispatching would take one of
    the last ``reserve`` idle workers. Under heavy load every worker is busy, batches fill while
    they wait, and it behaves like :class:`SizeOrTimeout`; at low load latency drops to about one
    service time.
    """

    max_batch: int = 50
    max_wait: float = 0.150
    reserve: int = 1

    def __post_init__(self) -> None:
        _check_batch(self.max_batch)
        _check_seconds("max_wait", self.max_wait)
        _check(
            isinstance(self.reserve, int) and self.reserve >= 0, "reserve", "idle workers >= 0", self.reserve
        )

    def decide(self, state: QueueState) -> Flush | Hold:
        if state.queued and state.queued < self.max_batch and state.idle_workers > self.reserve:
            return Flush(state.queued, "idle")
        return size_or_timeout(state, self.max_batch, self.max_wait)


@dataclasses.dataclass(frozen=True, slots=True)
class SlackDriven:
    """Wait for a full batch as long as every deadline allows, then go: reason "slack".

    A request's deadline is when its answer is due. The batch leaves when the tightest deadline
    among the queued requests is ``service_time + margin`` away (or ``max_batch`` wait), so
    batches grow exactly as far as the deadlines allow. A request whose deadline is less than
    one ``service_time`` away can no longer be answered in time: the batcher drops it
    (``drop_before``) instead of spending a GPU call on an answer nobody waits for.

    Requests without a deadline give it nothing to go by: they wait for a full batch.
    """

    max_batch: int = 50
    service_time: float = 0.200
    margin: float = 0.020

    def __post_init__(self) -> None:
        _check_batch(self.max_batch)
        _check_seconds("service_time", self.service_time)
        _check_seconds("margin", self.margin)

    @property
    def drop_before(self) -> float:
        return self.service_time

    def decide(self, state: QueueState) -> Flush | Hold:
        if not state.queued:
            return Hold(queued=1)
        due = state.next_deadline - self.service_time - self.margin
        if state.queued >= self.max_batch:
            reason = "size"
        elif state.now >= due:
            reason = "slack"
        elif state.idle_workers:
            return Hold(until=due, queued=self.max_batch)
        else:
            return Hold()
        return Flush(min(state.queued, self.max_batch), reason) if state.idle_workers else Hold()


@dataclasses.dataclass(slots=True)
class AIMD:
    """An adaptive batch size: additive increase, multiplicative decrease.

    The batch limit starts at ``start``; each call that took at most ``target`` seconds raises
    it by ``step`` (up to ``max_batch``), each call that took longer cuts it to ``backoff``
    times its size. (Every call counts, full or not: with several workers a wave of calls of
    the same size ends together, and counting only calls as large as the limit would raise it
    once per wave.) Batches leave like :class:`SizeOrTimeout` with the current limit
    as their size (with the default ``max_wait`` of 0: whatever waits, as soon as a worker is
    idle). With a service time that grows with the batch, the limit settles just under the size
    whose call takes ``target``; with a constant one it climbs to ``max_batch``.

    Not frozen: the limit is state, learned from :meth:`observe`; still pure (no clock, no I/O).
    """

    max_batch: int = 50
    target: float = 0.250
    step: int = 1
    backoff: float = 0.9
    max_wait: float = 0.0
    start: int = 1
    limit: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        _check_batch(self.max_batch)
        _check(0.0 < self.target < math.inf, "target", "a finite number of seconds > 0", self.target)
        _check(isinstance(self.step, int) and self.step >= 1, "step", "an integer >= 1", self.step)
        _check(0.0 < self.backoff < 1.0, "backoff", "a factor in (0, 1)", self.backoff)
        _check_seconds("max_wait", self.max_wait)
        _check(
            isinstance(self.start, int) and 1 <= self.start <= self.max_batch,
            "start",
            "1..max_batch",
            self.start,
        )
        self.limit = self.start

    def decide(self, state: QueueState) -> Flush | Hold:
        return size_or_timeout(state, self.limit, self.max_wait)

    def observe(self, size: int, seconds: float) -> None:
        """Learn from one worker call of ``size`` inputs that took ``seconds``."""
        if seconds > self.target:
            self.limit = max(1, int(self.limit * self.backoff))
        else:
            self.limit = min(self.max_batch, self.limit + self.step)


POLICIES: dict[str, Callable[..., Policy]] = {
    "size_or_timeout": SizeOrTimeout,
    "static": Static,
    "no_batching": NoBatching,
    "idle_aware": IdleAware,
    "slack_driven": SlackDriven,
    "aimd": AIMD,
}
"""Policies by the name a config file or command line gives them."""


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy from its name and its own parameters (``max_batch=50, max_wait=0.15``)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: expected one of {sorted(POLICIES)}, got {name!r}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"policy {name}: {exc}") from None
