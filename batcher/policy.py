"""Flush policies: when the waiting requests leave as a batch, and how many of them.

A policy is a small pure object. The batcher shows it a :class:`QueueState` and gets back a
decision: :class:`Flush` (take up to ``size`` requests now, for ``reason``) or :class:`Hold`
(ask again at ``until``, or as soon as ``queued`` requests wait, or a worker comes free). The
``Hold`` triggers let the batcher sleep instead of re-deciding on every arrival, which is what
keeps a simulation of millions of requests cheap.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True, slots=True)
class QueueState:
    """What a policy may look at: the time, the queue, and the workers free to take a batch."""

    now: float
    queued: int
    oldest_arrival: float | None
    idle_workers: int


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


@dataclasses.dataclass(frozen=True, slots=True)
class SizeOrTimeout:
    """Seed 000 §7.1: flush when ``max_batch`` wait or the oldest has waited ``max_wait``.

    Whichever comes first, and only when a worker is idle to take the batch: with every worker
    busy the requests keep collecting, and the next worker to free up takes a full batch.
    """

    max_batch: int = 50
    max_wait: float = 0.150

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 1024:
            raise ValueError(f"max_batch: expected 1..1024, got {self.max_batch}")
        if not 0.0 <= self.max_wait < math.inf:
            raise ValueError(f"max_wait: expected a finite number of seconds >= 0, got {self.max_wait}")

    def decide(self, state: QueueState) -> Flush | Hold:
        if state.oldest_arrival is None:
            return Hold(queued=1)
        if state.queued >= self.max_batch:
            reason = "size"
        elif state.now >= state.oldest_arrival + self.max_wait:
            reason = "timeout"
        elif state.idle_workers:
            return Hold(until=state.oldest_arrival + self.max_wait, queued=self.max_batch)
        else:
            return Hold()
        if not state.idle_workers:
            return Hold()
        return Flush(min(state.queued, self.max_batch), reason)


class Policy(Protocol):
    """What the batcher asks before every flush."""

    def decide(self, state: QueueState) -> Flush | Hold: ...


POLICIES: dict[str, Callable[..., Policy]] = {"size_or_timeout": SizeOrTimeout}
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
