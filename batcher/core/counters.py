"""What every backend counts as it works, whatever its mode: plain numbers, cheap to bump, and the
histogram they are observed into. Experiments print them, tests assert on them, and the metrics
registry exports them; each mode adds its own (the fixed mode's ``BatchCounters``)."""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
from typing import Self

WAIT_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (by upper bound), and their sum: cheap to observe.

    The metrics registry exports it as a Prometheus histogram at scrape time, so the hot path
    pays for one bisect and two additions, and takes no lock.
    """

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it) pairs, ending with "+Inf"."""
        running, pairs = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=False):
            running += count
            pairs.append((bound, running))
        return pairs


@dataclasses.dataclass(slots=True)
class Counters:
    """What every backend counts, whatever its mode: the shared ``/metrics`` families."""

    expired: int = 0  # queued past their deadline: Overloaded
    shed: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)  # by tier
    cancelled: int = 0  # callers gone, before or after dispatch
    restarts: int = 0  # workers killed (crash, hang, protocol fault) and started again
    timed_out: int = 0  # dispatched requests no worker answered by their deadline + hang_timeout
    queue_wait: collections.defaultdict[int, Histogram] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(lambda: Histogram(WAIT_BOUNDS))
    )  # seconds from arrival to dispatch, by tier index
    scale_events: collections.Counter[tuple[str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )  # decisions of a scaler that moved, by (direction, cause): batcher/core/scaler.py

    def copy(self) -> Self:
        """A deep copy: what a snapshot hands the asyncio thread, which must not read live counters."""
        return copy.deepcopy(self)
