"""An open-loop load driver: requests arrive on a schedule, whatever the batcher is doing.

Closed-loop drivers (N clients, each waiting for its answer) slow down when the server does and
hide its queueing; an open loop keeps offering the scheduled rate, which is what a fleet of
independent clients does. The driver enqueues through the batcher's synchronous API, so one
task drives any number of requests (no task per request), in real or in virtual time alike.

In virtual time a replay goes further (:mod:`batcher.sim.fixed.replay`): it hands a whole trace to the
batcher, so the clock stops only where the scheduler has something to decide, not at each of
millions of arrivals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import trio

from batcher.core.config import PoolConfig, QueueConfig
from batcher.fixed.batcher import Batcher, open_batcher
from batcher.fixed.policy import Policy, SizeOrTimeout
from batcher.fixed.request import Request
from batcher.fixed.slot import Spawn
from batcher.sim.arrivals import poisson, tier_mix
from batcher.sim.fixed.report import Report, summarize


async def drive(
    batcher: Batcher, times: Sequence[float] | np.ndarray, tiers: Sequence[str], timeout: float | None = None
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
    return summarize(requests, queue.tiers, batcher.counters, lag, pool.workers)
