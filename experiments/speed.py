"""Speed: simulated requests per CPU second, on a one-hour trace at 2,000 req/s (7.2 M requests).

    python -m experiments.speed

10 reference workers, SizeOrTimeout(50, 150 ms), Poisson arrivals, half paid and half free. The
clock stops only where the scheduler has something to decide (a flush, a timer, a worker freeing):
arrivals are admitted in bulk by the batcher's trace feed (``batcher.sim.fixed.replay.Replay``). ``--profile``
also prints the 25 functions with the most own time (cProfile, slower).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource

import matplotlib.pyplot as plt

from batcher.sim.arrivals import Trace, poisson
from batcher.sim.fixed.simulate import Progress, Scenario, print_progress, simulate
from experiments.common import HALF, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of arrivals")
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    scenario = Scenario(Trace.of(poisson(args.rate, args.duration), HALF), workers=args.workers)
    told: list[Progress] = []

    def progress(state: Progress) -> None:
        told.append(state)
        print_progress(state)

    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    result = simulate(scenario, progress, every=args.duration / 24)
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    report = result.report
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [
        {
            "requests": report.offered,
            "virtual s": result.virtual_seconds,
            "CPU s": result.cpu_seconds,
            "wall s": result.wall_seconds,
            "requests per CPU s": round(result.requests_per_cpu_second),
            "virtual s per wall s": result.virtual_seconds / result.wall_seconds,
            "peak memory MB": round(peak_mb),
            "p95 ms": report.latency.p95 * 1000,
            "mean batch": report.mean_batch,
            "profiled": args.profile,
        }
    ]
    figure, axis = plt.subplots(figsize=(6.5, 4))
    axis.plot([p.cpu_seconds for p in told], [p.ended / 1e6 for p in told], marker="o")
    axis.set(xlabel="CPU seconds", ylabel="requests ended (millions)",
             title=f"{report.offered / 1e6:.1f} M requests, {result.requests_per_cpu_second:,.0f} per CPU s")
    axis.grid(alpha=0.3)
    summary = f"""
{args.duration / 3600:g} h of arrivals at {args.rate:,.0f} req/s ({report.offered:,} requests) through the
production batcher and pool in virtual time took **{result.cpu_seconds:,.0f} CPU seconds**
({result.wall_seconds:,.0f} s wall):
**{result.requests_per_cpu_second:,.0f} simulated requests per CPU second**,
{result.virtual_seconds / result.wall_seconds:,.0f} virtual seconds per wall second,
peak memory {peak_mb:,.0f} MB.

Before the trace feed, the open-loop driver stopped the clock at every arrival (a `trio.sleep_until`
each): 26,000 requests per CPU second, about 4.6 minutes of CPU for the same hour, nine tenths of it
in trio's run loop (cProfile). The feed admits every arrival due at each wake-up of the flush loop,
and wakes it at the arrival that would have triggered it, so each decision sees exactly the same
queue (`tests/pure/test_simulate.py::test_a_replayed_trace_is_scheduled_exactly_as_on_time_arrivals_are`).
"""
    write("speed", rows, figure, summary, "python -m experiments.speed")


if __name__ == "__main__":
    main()
