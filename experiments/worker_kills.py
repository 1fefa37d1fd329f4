"""Open-loop load through the library against real `sleep` workers, one SIGKILLed every few seconds.

    python experiments/worker_kills.py --rate 1000 --duration 60 --kill-every 2

The reference run: 8 workers of 200 ms (capacity 2,000 requests/s) at 1,000 requests/s,
half paid and half free with the embedded default's budgets (1 s and 0.3 s), and a random live
worker killed with SIGKILL every ``--kill-every`` seconds, busy or idle. Prints the requests
offered, answered, failed (by error) and lost (never answered), p50/p99 latency by tier, and
the kills, restarts and retries. Exit status 1 if any request failed or was lost.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys

import numpy as np
import trio

from batcher.core.config import PoolConfig, QueueConfig
from batcher.fixed.batcher import Batcher, open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.request import Request, RequestState
from batcher.fixed.slot import SlotState
from batcher.fixed.worker import ProcessWorker
from batcher.placement.local import process_workers
from batcher.sim.arrivals import poisson, tier_mix

BUDGETS = (1.0, 0.3)  # paid, free: the embedded default's wait budgets


async def kill_workers(
    batcher: Batcher, every: float, seed: int, kills: list[tuple[float, int, str]]
) -> None:
    """SIGKILL a random live worker every ``every`` seconds, whatever it is doing."""
    pick = random.Random(seed)
    while True:
        await trio.sleep(every)
        live = [info for info in batcher.pool.workers() if info.state is not SlotState.STARTING and info.pid]
        if live:
            victim = pick.choice(live)
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            kills.append((trio.current_time(), victim.slot, victim.state.value))


async def drive(batcher: Batcher, times: np.ndarray, tiers: list[str], requests: list[Request]) -> None:
    """Offer one request at each time (seconds from now) into ``requests``; return once all ended."""
    start, ended = trio.current_time(), trio.Event()
    remaining = len(times)

    def on_done(request: Request) -> None:
        nonlocal remaining
        remaining -= 1
        if not remaining:
            ended.set()

    for index, (offset, tier) in enumerate(zip(times, tiers, strict=True)):
        await trio.sleep_until(start + float(offset))
        requests.append(request := batcher.request(f"request {index}", tier, on_done=on_done))
        batcher.enqueue(request)
    await ended.wait()


async def run(args: argparse.Namespace) -> int:
    spawn = process_workers(["sleep", "--latency-ms", str(args.latency_ms)], args.workers, kind=ProcessWorker)
    times = poisson(args.rate, args.duration, args.seed)
    tiers = tier_mix(len(times), {"paid": 0.5, "free": 0.5}, args.seed)
    kills: list[tuple[float, int, str]] = []
    pool = PoolConfig(workers=args.workers)
    policy = SizeOrTimeout(50, args.max_wait_ms / 1000)
    async with open_batcher(spawn, pool, policy, QueueConfig(wait_budgets=BUDGETS)) as batcher:
        requests: list[Request] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_workers, batcher, args.kill_every, args.seed, kills)
            with trio.move_on_after(args.duration + 30):  # whatever is not answered by then is lost
                await drive(batcher, times, tiers, requests)
            nursery.cancel_scope.cancel()
        counters = batcher.counters
        for request in requests:
            if not request.done:
                print(f"lost: request {request.id} ({request.state.value}) arrived {request.arrival:.3f} "
                      f"dispatched {request.dispatched_at}")
    done = [r for r in requests if r.state is RequestState.DONE]
    failed = collections.Counter(type(r.error).__name__ for r in requests if r.state is RequestState.FAILED)
    lost = len(times) - len(done) - sum(failed.values())
    print(f"offered {len(times):,} at {args.rate:g}/s for {args.duration:g}s")
    print(f"answered {len(done):,}  failed {sum(failed.values())} {dict(failed)}  lost {lost}")
    for name, index in (("all", None), ("paid", 0), ("free", 1)):
        latency = np.array([r.finished_at - r.arrival for r in done if index in (None, r.tier)])
        p50, p99, worst = np.percentile(latency, [50, 99, 100]) * 1000
        print(f"  {name:>4}: p50 {p50:.0f} ms  p99 {p99:.0f} ms  max {worst:.0f} ms")
    busy = sum(state == "busy" for _, _, state in kills)
    print(f"kills {len(kills)} ({busy} busy, {len(kills) - busy} idle)  restarts {counters.restarts}  "
          f"retries {counters.retries}  bisections {counters.bisections}  calls {counters.calls}")
    return 0 if not failed and not lost else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="offered requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=200.0, help="cost of one worker call")
    parser.add_argument("--max-wait-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    return trio.run(run, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
