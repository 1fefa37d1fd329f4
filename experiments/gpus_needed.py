"""Experiment 2: how many reference GPUs each policy needs for p95 <= 500 ms, by offered load.

    python -m experiments.gpus_needed

For each policy and load, the smallest worker count whose run serves every request with p95 within
the 500 ms p95 budget (search: up from the capacity floor load / 250 by doubling, then bisect).
The capacity arithmetic: 8 GPUs is the floor at 2,000 req/s, 16 if batches run half full; the half-full
fleet is SizeOrTimeout with max_batch 25.
"""

from __future__ import annotations

import argparse
import math

import matplotlib.pyplot as plt

from experiments.common import PER_GPU, SLO, poisson_scenario, run, write

LOADS = (100, 250, 500, 1000, 1500, 2000, 3000)
VARIANTS = {  # label: (policy, params)
    "size_or_timeout": ("size_or_timeout", {}),
    "idle_aware": ("idle_aware", {}),
    "slack_driven": ("slack_driven", {}),
    "aimd": ("aimd", {}),
    "half-full batches (max_batch 25)": ("size_or_timeout", {"max_batch": 25}),
    "no_batching": ("no_batching", {}),
}
CEILING = 1024


def meets_budget(policy: str, params: dict, load: float, workers: int, duration: float) -> bool:
    scenario = poisson_scenario(load, duration, policy, workers=workers).with_(params=params)
    report = run(scenario, f"{policy} {params or ''} {load}/s on {workers}").report
    return report.dropped == 0 and report.latency.p95 <= SLO


def fewest(policy: str, params: dict, load: float, duration: float) -> int | None:
    """The smallest fleet meeting the budget, or None if even CEILING workers do not."""
    low = max(1, math.ceil(load / PER_GPU)) - 1  # known (or assumed) too few
    high = low + 1
    while not meets_budget(policy, params, load, high, duration):
        low, high = high, high * 2
        if high > CEILING:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        if meets_budget(policy, params, load, middle, duration):
            high = middle
        else:
            low = middle
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    args = parser.parse_args()
    rows = []
    for label, (policy, params) in VARIANTS.items():
        for load in LOADS:
            needed = fewest(policy, params, load, args.duration)
            rows.append({"policy": label, "offered/s": load, "floor (load/250)": math.ceil(load / PER_GPU),
                         "workers for p95 <= 500 ms": needed if needed is not None else "never"})

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for label, marker, size in zip(
        VARIANTS, "osDv^x", (11, 8, 5, 6, 6, 6), strict=False
    ):  # some lines coincide
        points = [r for r in rows if r["policy"] == label and r["workers for p95 <= 500 ms"] != "never"]
        axis.plot([r["offered/s"] for r in points], [r["workers for p95 <= 500 ms"] for r in points],
                  marker=marker, markersize=size, label=label)
    axis.plot(LOADS, [math.ceil(load / PER_GPU) for load in LOADS], "k:", label="floor: load / 250")
    axis.set(xlabel="offered req/s", ylabel="workers needed", yscale="log", title="GPUs for p95 <= 500 ms")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)

    def need(label: str, load: int):
        return next(
            r["workers for p95 <= 500 ms"] for r in rows if r["policy"] == label and r["offered/s"] == load
        )

    summary = f"""
Smallest fleet of 200 ms reference workers that answers every request with p95 <= 500 ms,
{args.duration:g} s of Poisson arrivals per run.

- At 2,000 req/s SizeOrTimeout needs **{need('size_or_timeout', 2000)}** workers: 8 is the floor (ρ = 1
  leaves the queue no slack), one more makes it work. With batches capped at 25 (half full) the floor
  doubles to 16 and the need is **{need('half-full batches (max_batch 25)', 2000)}**: the batcher decides
  which price you pay.
- IdleAware needs {need('idle_aware', 2000)} at 2,000 req/s: the same as SizeOrTimeout, while its low-load
  latency is a service time (experiment 3).
- Without batching, 2,000 req/s needs {need('no_batching', 2000)} workers (5 calls a second each).
- AIMD needs one or two more than SizeOrTimeout: it holds no worker back (experiment 3).
- Exactly at the floor (ρ = 1) the queue is a random walk, and whether p95 stays under 500 ms depends
  on how long the run lasts: {need('size_or_timeout', 3000)} workers passed {args.duration:g} s at
  3,000 req/s, 8 failed at 2,000. Plan for the floor plus one, not the floor.
"""
    write("gpus_needed", rows, figure, summary, "python -m experiments.gpus_needed")


if __name__ == "__main__":
    main()
