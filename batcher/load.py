"""An open-loop load driver: requests arrive on a schedule, whatever the batcher is doing.

Closed-loop drivers (N clients, each waiting for its answer) slow down when the server does and
hide its queueing; an open loop keeps offering the scheduled rate, which is what a fleet of
independent clients does. The driver enqueues through the batcher's synchronous API, so one
task drives any number of requests (no task per request), in real or in virtual time alike.

In virtual time a :class:`Replay` goes further: it hands a whole trace to the batcher as a
:class:`~batcher.fixed.Feed`, so the clock stops only where the scheduler has something to
decide, not at each of millions of arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import trio

from batcher.arrivals import poisson, tier_mix
from batcher.config import PoolConfig, QueueConfig
from batcher.fixed import Batcher, open_batcher
from batcher.policy import Policy, SizeOrTimeout
from batcher.pool import Spawn
from batcher.report import Report, summarize
from batcher.types import Request


async def drive(
    batcher: Batcher, times: Sequence[float], tiers: Sequence[str], timeout: float | None = None
) -> tuple[list[Request], float]:
    """Offer one request at each time (seconds from now); return them all once all have ended.

    Also returns the worst lag between a scheduled arrival and the moment it was offered: a
    driver that cannot keep up would understate latency, so the report shows it.
    """
    start = trio.current_time()
    requests: list[Request] = []
    remaining = len(times)
    all_ended = trio.Event()
    lag = 0.0

    def ended(request: Request) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            all_ended.set()

    for index, (offset, tier) in enumerate(zip(times, tiers, strict=True)):
        scheduled = start + float(offset)
        if trio.current_time() < scheduled:
            await trio.sleep_until(scheduled)
        request = batcher.request(f"request {index}", tier, timeout, on_done=ended)
        lag = max(lag, request.arrival - scheduled)
        requests.append(request)
        batcher.enqueue(request)
    if remaining:
        await all_ended.wait()
    return requests, lag


async def open_loop(
    spawn: Spawn,
    rate: float,
    duration: float,
    shares: dict[str, float],
    pool: PoolConfig = PoolConfig(),
    policy: Policy = SizeOrTimeout(),
    queue: QueueConfig = QueueConfig(),
    seed: int = 0,
) -> Report:
    """Start workers, offer a Poisson stream of ``rate``/s for ``duration`` s, report the run."""
    times = poisson(rate, duration, seed)
    tiers = tier_mix(len(times), shares, seed)
    async with open_batcher(spawn, pool, policy, queue) as batcher:
        requests, lag = await drive(batcher, times, tiers)
    return summarize(requests, queue.tiers, batcher.stats, lag, pool.workers)


class Replay:
    """A trace as a :class:`~batcher.fixed.Feed`: requests made when due, with their exact arrival.

    ``times`` and ``deadlines`` are trio clock readings (``deadlines`` already filled in for
    every arrival); ``tier`` holds each arrival's index into ``names``. ``batcher.feed(replay)``
    starts it.
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
            for arrival, tier, budget in zip(arrivals, tiers, budgets)
        ]

    def next_wake(self, more: int, until: float, drop_before: float) -> float:
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
