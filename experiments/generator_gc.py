"""The load generators' garbage collector, off while they time a server.

A generator that pauses for a full collection of its own heap charges that pause to the server
as latency: every answer that arrives meanwhile is read late. In the test suite the generator
is the test runner, whose heap holds every test module it collected (~450,000 objects: a full
collection takes 0.2 s here, several times that beside busy processes), so one such pause can
put a fleet's answers past a bound they met. Request objects die by reference counting, so a
run without the cyclic collector grows only by its few cycles; it catches up before and after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Collect once, then run the block with the cyclic collector disabled (as it was after)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
