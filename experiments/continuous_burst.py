"""L7: demand doubles in five minutes; paid stays within its TTFT budget while free is shed, and
the Retry-After each shed request is told is compared with when the queue really drained.

One 70B replica on 4 x A100 (smaller than 8 x H100, so that minutes replay in seconds) takes
1,000 prompt and 200 answer tokens a request, 40 % paid, through the production pool, router and
token admission: 5 req/s for 60 s, rising linearly to 10 req/s over 300 s, then 60 s at 10; wait
budgets 1 s. A shed request's real drain is how long after its refusal the newest request
admitted before it got its first token. The claim and the figures:
experiments/docs/continuous-overload.md.

    python -m experiments.continuous_burst
    python -m experiments.continuous_burst --tpot-target-ms 50

With ``--tpot-target-ms`` the paid tier promises that time per output token: the engine seats no
more sequences than keep a decode step within it (workers/engine/seats.py), priced by the
replica's own cost model; the results are written as ``continuous_burst_tpot``.
"""

from __future__ import annotations

import argparse

import numpy as np

from batcher.core.config import QueueConfig
from batcher.sim.arrivals import piecewise
from batcher.sim.continuous.replay import FINISHED, SHED, Outcomes
from batcher.sim.continuous.workload import Lengths, Workload
from experiments.common import plt, write
from experiments.continuous_common import KV_BLOCKS_SMALL_70B, SMALL_70B, pool_replay

BASE, PEAK, BEFORE, RAMP, AFTER, WINDOW = 5.0, 10.0, 60, 300, 60, 30
BUDGETS, PAID_SHARE, PIECES = (1.0, 1.0), 0.4, 30


def arrivals() -> np.ndarray:
    """``BEFORE`` s at the base rate, a linear rise to the peak in ``PIECES`` steps, ``AFTER`` s of peak."""
    rise = [(RAMP / PIECES, BASE + (PEAK - BASE) * (k + 0.5) / PIECES) for k in range(PIECES)]
    return piecewise([(BEFORE, BASE), *rise, (AFTER, PEAK)], seed=7)


def real_drain(out: Outcomes, order: np.ndarray) -> np.ndarray:
    """For each shed request (in ``order`` of sending), seconds from its refusal until the newest
    request admitted before it had its first token; NaN where none had been admitted."""
    shed = out.outcome == SHED
    admitted = np.flatnonzero(~shed & ~np.isnan(out.first))
    admitted = admitted[np.argsort(out.sent[admitted], kind="stable")]
    drains = np.full(len(out.sent), np.nan)
    for index in order[shed[order]]:
        before = np.searchsorted(out.sent[admitted], out.sent[index], side="right") - 1
        if before >= 0:
            newest = admitted[before]
            drains[index] = out.first[newest] - out.sent[index]
    return drains


def p95_ms(values: np.ndarray) -> float:
    return round(float(np.percentile(values, 95)) * 1000, 1) if len(values) else 0.0


def share(among: np.ndarray, which: np.ndarray) -> float:
    return float((among & which).sum()) / max(int(among.sum()), 1)


def main(tpot_target_ms: float = 0.0) -> None:
    tiers = {"paid": PAID_SHARE, "free": 1 - PAID_SHARE}
    fixed = Lengths("fixed", 1000, 1000), Lengths("fixed", 200, 200)
    workload = Workload.synthetic(arrivals(), tiers, *fixed, seed=7)
    targets = (tpot_target_ms / 1000, 0.0) if tpot_target_ms else None
    queue = QueueConfig(wait_budgets=BUDGETS, tpot_targets=targets)
    run = pool_replay(workload, queue, cost=SMALL_70B, num_blocks=KV_BLOCKS_SMALL_70B)
    out = run.outcomes
    drain = real_drain(out, np.argsort(out.sent, kind="stable"))
    ttft, tpot = out.first - out.sent, (out.end - out.first) / np.maximum(out.tokens - 1, 1)
    rows = []
    for start in range(0, BEFORE + RAMP + AFTER, WINDOW):
        mine = (workload.times >= start) & (workload.times < start + WINDOW)
        row: dict = {"from s": start, "offered req/s": round(mine.sum() / WINDOW, 2)}
        for tier, name in enumerate(workload.tiers):
            ours = mine & (workload.tier == tier)
            done = ours & (out.outcome == FINISHED)
            row[f"{name} TTFT p95 ms"] = p95_ms(ttft[done])
            row[f"{name} TPOT p95 ms"] = p95_ms(tpot[done])
            row[f"{name} shed %"] = round(100 * share(ours, out.outcome == SHED), 1)
        shed = mine & (out.outcome == SHED) & ~np.isnan(drain)
        row["Retry-After p50 s"] = round(float(np.median(out.retry_after[shed])), 2) if shed.any() else 0
        row["real drain p50 s"] = round(float(np.median(drain[shed])), 2) if shed.any() else 0
        rows.append(row)
    shed = (out.outcome == SHED) & ~np.isnan(drain)
    error = out.retry_after[shed] - drain[shed]
    paid, free = workload.tier == 0, workload.tier == 1
    done = out.outcome == FINISHED
    counts = out.counts()
    target = f", paid TPOT target {tpot_target_ms:g} ms" if tpot_target_ms else ""
    summary = (
        f"Demand {BASE:g} -> {PEAK:g} req/s over {RAMP} s on one 70B replica (4 x A100), 40 % paid, wait "
        f"budgets {BUDGETS[0]:g} s / {BUDGETS[1]:g} s"
        f"{target}: "
        f"{len(workload):,} requests, {counts['finished']:,} "
        f"finished, {counts['shed']:,} shed, {counts['expired']:,} expired. Paid TTFT p95 over the run "
        f"{np.percentile(ttft[paid & done], 95) * 1000:,.0f} ms (TPOT p95 "
        f"{np.percentile(tpot[paid & done], 95) * 1000:.0f} ms), paid shed "
        f"{100 * share(paid, out.outcome == SHED):.1f} %, free shed "
        f"{100 * share(free, out.outcome == SHED):.1f} %. "
        f"Retry-After against the real drain over {shed.sum():,} refusals: told - real p50 "
        f"{np.median(error):+.2f} s, p10 {np.percentile(error, 10):+.2f} s, "
        f"p90 {np.percentile(error, 90):+.2f} s; "
        f"within 0.5 s of the drain for {100 * (abs(error) <= 0.5).mean():.0f} %."
    )
    figure, axis = plt.subplots(figsize=(7, 4))
    mid = [r["from s"] + WINDOW / 2 for r in rows]
    axis.plot(mid, [r["paid TTFT p95 ms"] for r in rows], "o-", label="paid TTFT p95, ms")
    axis.plot(mid, [r["free TTFT p95 ms"] for r in rows], "s-", label="free TTFT p95, ms")
    axis.set_xlabel("virtual seconds (demand doubles from 60 s to 360 s)")
    axis.set_ylabel("TTFT p95, ms")
    other = axis.twinx()
    other.plot(mid, [r["free shed %"] for r in rows], "^--", color="tab:red", label="free shed %")
    other.set_ylabel("free shed, %", color="tab:red")
    axis.legend(loc="upper left")
    axis.set_title("Demand doubles in five minutes: paid within budget, free shed")
    option = f" --tpot-target-ms {tpot_target_ms:g}" if tpot_target_ms else ""
    name = "continuous_burst_tpot" if tpot_target_ms else "continuous_burst"
    write(name, rows, figure, summary, f"python -m experiments.continuous_burst{option}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpot-target-ms", type=float, default=0.0, help="the paid tier's (0: none)")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args().tpot_target_ms)
