"""Virtual time for both simulators: one trio run under ``MockClock``, a function of its seed.

trio runs the tasks woken at one virtual instant (a replica's read and the arrival it lets in,
two replicas ending a step together) in an order it draws from a generator of its own, which
each process seeds afresh; where such a tie decides something (the aged-work credit of a
dispatch pass, which sequence a full cache preempts), two runs of one scenario would differ.
:func:`run_virtual` seeds that generator for the run, and gives it back as it was.

trio (0.35) has no public way to do this. Its one hook is its Hypothesis plugin
(``trio._core._run._hypothesis_plugin_setup``, run by Hypothesis's entry points whenever
``hypothesis`` is imported): it registers the generator, ``_r``, with
``hypothesis.register_random``, which seeds it only inside a ``@given`` test, and it flips
``_ALLOW_DETERMINISTIC_SCHEDULING``, which changes the rule itself: a batch of woken tasks is
sorted by creation and shuffled, where otherwise it is reversed or not at a coin's toss. So the
rule depends on whether anything in the process imported Hypothesis (pytest's plugin does): one
seed gave one order under pytest and another from ``ferry simulate``. A ``random.seed`` or an
``Instrument`` cannot reach either. Both private names are therefore read here and nowhere else,
and both are set for the run and restored after it: the sorted-and-shuffled rule, which depends
on nothing but the seed and the order tasks were created, whoever imported what.
tests/pure/test_virtual.py fails if a trio upgrade renames either.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
import trio.testing

T = TypeVar("T")


def run_virtual(fn: Callable[..., Awaitable[T]], *args: Any, seed: int) -> T:
    """``trio.run(fn, *args)`` in virtual time, trio's order of simultaneous tasks drawn from ``seed``."""
    scheduler = trio._core._run
    order, rule = scheduler._r, scheduler._ALLOW_DETERMINISTIC_SCHEDULING
    if not isinstance(order, random.Random) or not isinstance(rule, bool):
        raise RuntimeError(f"trio {trio.__version__}: its scheduler moved (see {__name__})")
    state = order.getstate()
    order.seed(seed)
    scheduler._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]  # Final in trio
    try:
        return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        scheduler._ALLOW_DETERMINISTIC_SCHEDULING = rule  # type: ignore[misc]
        order.setstate(state)
