"""Experiment 1: p95 latency against the flush timeout T, at 20, 200, 1,000 and 2,000 req/s.

    python -m experiments.wait_vs_load

The capacity arithmetic claims: a worker serves 250 req/s in full batches; at 20 req/s batches never fill
and latency is about T + 200 ms; T of 150 ms or less keeps p95 under 500 ms. SizeOrTimeout
(max_batch 50) on 8 and 16 reference workers, 60 s of Poisson arrivals per point.
"""

from __future__ import annotations

import argparse

import matplotlib.pyplot as plt

from experiments.common import PER_GPU, SERVICE, SLO, markdown, ms, poisson_scenario, run, write

LOADS = (20, 200, 1000, 2000)
WAITS_MS = (0, 25, 50, 75, 100, 125, 150, 175, 200, 250, 300)
FLEETS = (8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point")
    args = parser.parse_args()
    rows = []
    for workers in FLEETS:
        for load in LOADS:
            for wait in WAITS_MS:
                scenario = poisson_scenario(load, args.duration, workers=workers)
                scenario = scenario.with_(params={"max_batch": 50, "max_wait": wait / 1000})
                report = run(scenario, f"{workers} workers, {load}/s, T={wait} ms").report
                rows.append({
                    "workers": workers, "offered/s": load, "T ms": wait,
                    "p50 ms": ms(report.latency.p50), "p95 ms": ms(report.latency.p95),
                    "p99 ms": ms(report.latency.p99), "mean batch": report.mean_batch,
                    "GPU busy %": 100 * report.busy_fraction,
                })
    capacity = []
    for workers in FLEETS:  # offered at twice capacity: what a worker serves flat out
        report = run(
            poisson_scenario(2 * workers * PER_GPU, 20.0, workers=workers), f"{workers} workers flat out"
        ).report
        capacity.append(
            {
                "workers": workers,
                "offered/s": round(report.offered_rate),
                "achieved/s": round(report.achieved_rate),
                "per worker/s": round(report.achieved_rate / workers),
                "mean batch": report.mean_batch,
            }
        )

    figure, axes = plt.subplots(1, len(FLEETS), figsize=(11, 4.2), sharey=True)
    for axis, workers in zip(axes, FLEETS, strict=False):
        for load in LOADS:
            points = [r for r in rows if r["workers"] == workers and r["offered/s"] == load]
            axis.plot(
                [r["T ms"] for r in points], [r["p95 ms"] for r in points], marker="o", label=f"{load} req/s"
            )
        axis.plot(WAITS_MS, [w + SERVICE * 1000 for w in WAITS_MS], "k:", label="T + 200 ms")
        axis.axhline(SLO * 1000, color="red", lw=0.8, ls="--", label="500 ms budget")
        axis.axvline(150, color="grey", lw=0.6)
        axis.set(title=f"SizeOrTimeout(50, T), {workers} workers", xlabel="T (ms)", ylim=(0, 1000))
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("p95 latency (ms)")
    axes[-1].legend(fontsize=8)

    def p95(workers: int, load: int, wait: int) -> float:
        return next(
            r["p95 ms"] for r in rows if (r["workers"], r["offered/s"], r["T ms"]) == (workers, load, wait)
        )

    low = [p95(16, 20, w) - w for w in WAITS_MS]
    worst_150 = {
        w: max(p95(w, load, wait) for load in LOADS for wait in WAITS_MS if wait <= 150) for w in FLEETS
    }
    summary = f"""
Claims of the capacity arithmetic, checked in virtual time with the production batcher and pool:

- **Capacity 250 req/s per worker**: offered twice the capacity, each worker served
  {', '.join(f"{c['per worker/s']} req/s ({c['workers']} workers)" for c in capacity)}, in batches of
  {capacity[0]['mean batch']:.1f}.
- **At 20 req/s latency ≈ T + 200 ms**: p95 − T at 20 req/s stays within
  {min(low):.0f}..{max(low):.0f} ms for every T from 0 to 300 ms (16 workers).
- **T ≤ 150 ms keeps p95 under 500 ms**: the worst p95 with T ≤ 150 ms over the four loads is
  {worst_150[16]:.0f} ms on 16 workers and {worst_150[8]:.0f} ms on 8. On 8 workers 2,000 req/s *is* the
  capacity (ρ = 1): the queue has no slack, and p95 there depends on how long the run lasts — 8 is the
  floor, not a working point.
- T = 0 is no cure for latency: at 1,000 req/s and above it flushes small batches that keep every
  worker busy (GPU busy ≈ 100 %), and p95 rises to {p95(16, 1000, 0):.0f} ms at 1,000 req/s on 16 workers,
  against {p95(16, 1000, 25):.0f} ms with T = 25 ms.

Capacity check (offered twice the capacity, 20 s):

{markdown(capacity)}
"""
    write("wait_vs_load", rows, figure, summary, "python -m experiments.wait_vs_load")


if __name__ == "__main__":
    main()
