"""Waiting on a condition the system exposes: the one polling helper of the tests, for each way a
test can wait (blocking on the real clock, in trio, in asyncio).

A test never sleeps for "long enough" and then looks: it waits until what it needs holds (a
``/readyz`` field, a metric, a file, a process gone, a snapshot of the core), within a bound,
and fails saying what did not happen. ``condition()`` is called at once and then every ``every``
seconds; its first true value is returned. Past ``within`` seconds an ``AssertionError`` names
``what`` was awaited and the last value seen. In trio the clock is trio's, so under
``MockClock`` both the bound and the poll are virtual time.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


def _not_met(what: str, within: float, last: object) -> AssertionError:
    return AssertionError(f"waited {within:g} s for {what}; last seen: {last!r}")


def until(condition: Callable[[], T], what: str, within: float = 20.0, every: float = 0.02) -> T:
    """Block on the real clock until ``condition()`` is true; its value. ``every=0`` polls
    without pause (the moment it turns true matters)."""
    deadline = time.monotonic() + within
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _not_met(what, within, value)
        time.sleep(every)  # the poll interval
    return value


async def until_trio(condition: Callable[[], T], what: str, within: float = 20.0, every: float = 0.01) -> T:
    """In trio, until ``condition()`` is true; its value (virtual time under MockClock)."""
    deadline = trio.current_time() + within
    while not (value := condition()):
        if trio.current_time() >= deadline:
            raise _not_met(what, within, value)
        await trio.sleep(every)  # the poll interval
    return value


async def until_asyncio(condition: Callable[[], Any], what: str, within: float = 20.0,
                        every: float = 0.01) -> Any:
    """In asyncio, until ``condition()`` (a plain or an async function) is true; its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise _not_met(what, within, value)
        await asyncio.sleep(every)  # the poll interval
