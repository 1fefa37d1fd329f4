"""Demand doubles in five minutes and a worker takes eight minutes to start: no scaler, the
scaler, and the scaler with a warm pool, through the production batcher, pool and scaler in
virtual time.

A fixed-mode model on reference GPUs (200 ms a call of up to 10 requests: 50 requests/s each),
60 % paid, wait budgets 2 s paid and 0.5 s free: 80 req/s for 600 s (a warm pool is warm by
then), a linear rise to 160 req/s over 300 s, 600 s at 160, then 900 s back at 80. Fleets: two
workers (sized for the base, no scaler), four (sized for the peak, no scaler), and min 2 / max 6
with the scaler, without and with two warm workers; every start takes START_S. Paid latency
p95, each tier's shed share, and the GPU-seconds held (starting, warm, serving or draining).
The claim and the figures: experiments/docs/scaling.md.

    python -m experiments.scaling
"""

from __future__ import annotations

import numpy as np

from batcher.core.config import QueueConfig, ScalerConfig
from batcher.sim.arrivals import Trace, piecewise
from batcher.sim.fixed.simulate import Scenario, Simulation, simulate
from experiments.common import plt, write

BASE, PEAK, BEFORE, RAMP, HOLD, AFTER, PIECES = 80.0, 160.0, 600, 300, 600, 900, 30
START_S, PAID_SHARE, BATCH = 480.0, 0.6, 10
QUEUE = QueueConfig(wait_budgets=(2.0, 0.5))
ARMS = {
    "2 workers, no scaler": (2, None),
    "4 workers, no scaler": (4, None),
    "scaler 2..6": (2, ScalerConfig(2, 6, scale_down_after=60.0)),
    "scaler 2..6 + 2 warm": (2, ScalerConfig(2, 6, warm_workers=2, scale_down_after=60.0)),
}


def trace() -> Trace:
    rise = [(RAMP / PIECES, BASE + (PEAK - BASE) * (k + 0.5) / PIECES) for k in range(PIECES)]
    times = piecewise([(BEFORE, BASE), *rise, (HOLD, PEAK), (AFTER, BASE)], seed=7)
    return Trace.of(times, {"paid": PAID_SHARE, "free": 1 - PAID_SHARE}, seed=7)


def row(name: str, run: Simulation, reference: float) -> dict:
    report = run.report
    offered = {tier: int((run.scenario.trace.tier == i).sum()) for i, tier in enumerate(("paid", "free"))}
    return {
        "fleet": name,
        "paid p95 ms": round(report.by_tier["paid"].p95 * 1000),
        "paid shed %": round(100 * report.dropped_by_tier["paid"] / offered["paid"], 2),
        "free shed %": round(100 * report.dropped_by_tier["free"] / offered["free"], 2),
        "GPU-seconds": round(run.gpu_seconds),
        "GPU-seconds vs 4 workers": round(run.gpu_seconds / reference, 2),
        "most workers held": max(run.held),
    }


def main() -> None:
    arrivals = trace()
    runs = {}
    for name, (workers, scaling) in ARMS.items():
        scenario = Scenario(arrivals, params={"max_batch": BATCH}, workers=workers, queue=QUEUE,
                            scaling=scaling, start_s=START_S if scaling else 0.0, seed=7)
        runs[name] = simulate(scenario)
    reference = runs["4 workers, no scaler"].gpu_seconds
    rows = [row(name, run, reference) for name, run in runs.items()]
    scaled, warm = rows[2], rows[3]
    summary = (
        f"Demand {BASE:g} -> {PEAK:g} req/s over {RAMP} s, {len(arrivals):,} requests, 60 % paid, budgets "
        f"2 s / 0.5 s, a start of {START_S:g} s. Without a scaler, two workers shed "
        f"{rows[0]['paid shed %']} % of paid and {rows[0]['free shed %']} % of free; four shed "
        f"{rows[1]['paid shed %']} % and {rows[1]['free shed %']} % and hold {rows[1]['GPU-seconds']:,} "
        f"GPU-seconds. The scaler sheds {scaled['paid shed %']} % of paid ({scaled['free shed %']} % of "
        f"free) while its starts take eight minutes, and holds "
        f"{scaled['GPU-seconds vs 4 workers']}x the four-worker fleet's GPU time; with two warm workers it "
        f"sheds {warm['paid shed %']} % of paid and {warm['free shed %']} % of free for "
        f"{warm['GPU-seconds vs 4 workers']}x."
    )
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        axis.plot(np.arange(len(run.held)), run.held, label=name)
    axis.set_xlabel("virtual seconds (demand doubles from 600 s to 900 s, falls back at 1,500 s)")
    axis.set_ylabel("workers held")
    other = axis.twinx()
    counts, edges = np.histogram(arrivals.times, bins=np.arange(0, arrivals.times[-1] + 30, 30))
    other.plot(edges[:-1] + 15, counts / 30, ":", color="grey", label="offered req/s")
    other.set_ylabel("offered requests/s", color="grey")
    axis.legend(loc="upper right", fontsize=8)
    axis.set_title(f"Demand doubles in five minutes, a start takes {START_S / 60:g} minutes")
    write("scaling", rows, figure, summary, "python -m experiments.scaling")


if __name__ == "__main__":
    main()
