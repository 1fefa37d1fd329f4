"""Replaying a trace in virtual time without stopping the clock at every arrival.

A :class:`Replay` is the trace as the production :class:`~batcher.fixed.batcher.Batcher`'s
:class:`~batcher.fixed.batcher.Arrivals` (``batcher.feed(replay)``): at each wake-up the flush
loop admits the arrivals that are due, each with its exact arrival time, and it also wakes at the
first future arrival that would have woken it (the one that fills the next batch, or one whose
deadline comes first). Every decision sees exactly the requests that have arrived, as with
on-time enqueueing (``tests/pure/test_simulate.py`` checks the two timelines are equal), but
virtual time stops only where the scheduler has something to decide: the speed of ``ferry simulate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from batcher.fixed.batcher import Batcher
from batcher.fixed.request import Request


class Replay:
    """A trace fed to ``batcher``: requests made when due, with their exact arrival.

    ``times`` and ``deadlines`` are trio clock readings (``deadlines`` already filled in for
    every arrival); ``tier`` holds each arrival's index into ``names``. ``batcher.feed(replay)``
    starts it. :meth:`due` gives the arrivals to admit now, :meth:`next_wake` when the loop must
    wake for the ones still to come.
    """

    _SCAN = 4096  # arrivals looked at per step when searching for an out-of-order deadline

    def __init__(
        self,
        batcher: Batcher,
        times: np.ndarray,
        tier: np.ndarray,
        names: Sequence[str],
        deadlines: np.ndarray,
        on_done: Callable[[Request], None],
        input: str = "",
    ) -> None:
        self._batcher = batcher
        self._times = times
        self._tier = tier
        self._names = list(names)
        self._deadlines = deadlines
        self._on_done = on_done
        self._input = input
        # _later[i]: the earliest deadline of arrivals i.. (one out of order needs an early wake)
        self._later = np.minimum.accumulate(deadlines[::-1])[::-1] if len(deadlines) else deadlines
        self.admitted = 0

    def due(self, now: float) -> list[Request]:
        start, times = self.admitted, self._times
        if start >= len(times) or times[start] > now:
            return []
        end = int(np.searchsorted(times, now, side="right"))
        self.admitted = end
        make, names, on_done, text = self._batcher.request, self._names, self._on_done, self._input
        arrivals = times[start:end].tolist()
        budgets = (self._deadlines[start:end] - times[start:end]).tolist()
        tiers = self._tier[start:end].tolist()
        return [
            make(text, names[tier], budget, on_done, arrival)
            for arrival, tier, budget in zip(arrivals, tiers, budgets, strict=False)
        ]

    def next_wake(self, more: int, until: float, drop_before: float) -> float:
        """When the loop must wake for arrivals still to come (inf: not before ``until``): the
        arrival that brings ``more`` requests to the queue, or the first arrival whose deadline,
        less ``drop_before``, comes before ``until``."""
        pos, times = self.admitted, self._times
        if pos >= len(times):
            return math.inf
        wake = float(times[pos + more - 1]) if 0 < more <= len(times) - pos else math.inf
        limit = min(wake, until)
        if self._later[pos] - drop_before >= until:
            return wake
        while pos < len(times) and times[pos] < limit:  # rare: a later arrival is due sooner
            chunk = slice(pos, pos + self._SCAN)
            early = np.flatnonzero(self._deadlines[chunk] - drop_before < until)
            if len(early):
                return min(wake, float(times[pos + early[0]]))
            pos += self._SCAN
        return wake
