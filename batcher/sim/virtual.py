"""Virtual time for both simulators: one trio run under ``MockClock``, a function of its seed.

trio runs the tasks woken at one virtual instant (a replica's read and the arrival it lets in,
two replicas ending a step together) in an order it draws from a generator of its own, which
each process seeds afresh; where such a tie decides something (the aged-work credit of a
dispatch pass, which sequence a full cache preempts), two runs of one scenario would differ.
:func:`run_virtual` seeds that generator (``trio._core._run._r``, the one trio's Hypothesis
plugin seeds) for the run, and gives it back as it was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
import trio.testing

T = TypeVar("T")


def run_virtual(fn: Callable[..., Awaitable[T]], *args: Any, seed: int) -> T:
    """``trio.run(fn, *args)`` in virtual time, trio's order of simultaneous tasks drawn from ``seed``."""
    order = trio._core._run._r
    state = order.getstate()
    order.seed(seed)
    try:
        return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        order.setstate(state)
