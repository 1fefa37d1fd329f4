"""Open-loop Poisson load through the library (no HTTP) against real `sleep` worker processes.

    python experiments/open_loop.py --rate 1800 --duration 20

prints achieved rate, p50/p95/p99 latency (all and by tier), mean batch size and flush reasons.
8 workers of 200 ms serve at most 8 x 50 / 0.2 = 2,000 requests per second.
"""

from __future__ import annotations

import argparse
import json
import sys

import trio

from batcher.core.config import PoolConfig
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.worker import ProcessWorker
from batcher.placement.local import process_workers
from batcher.sim.fixed.load import open_loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1800.0, help="offered requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=200.0, help="cost of one worker call")
    parser.add_argument("--max-batch", type=int, default=50)
    parser.add_argument("--max-wait-ms", type=float, default=150.0)
    parser.add_argument("--dispatch-ahead-ms", type=float, default=0.0, help="PoolConfig.dispatch_ahead")
    parser.add_argument("--paid-share", type=float, default=0.5, help="share of paid requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = parser.parse_args()

    spawn = process_workers(["sleep", "--latency-ms", str(args.latency_ms)], args.workers, kind=ProcessWorker)
    report = trio.run(
        open_loop,
        spawn,
        args.rate,
        args.duration,
        {"paid": args.paid_share, "free": 1 - args.paid_share},
        PoolConfig(workers=args.workers, dispatch_ahead=args.dispatch_ahead_ms / 1000),
        SizeOrTimeout(args.max_batch, args.max_wait_ms / 1000),
    )
    print(report.table())
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report.as_dict(), out, indent=2)
    return 0 if not report.errors else 1


if __name__ == "__main__":
    sys.exit(main())
