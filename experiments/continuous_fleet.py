"""L2: the fleet of 70B replicas (8 x H100 each) for 500 requests/s of 1,500 prompt and 300 answer
tokens, TTFT p95 under 1 s and TPOT p95 under 50 ms, against the arithmetic estimate.

One replica (prefill and decode together, chunked, the production scheduler and pool over the
cost model) is driven at rising Poisson rates; the highest rate that meets both targets is its
capacity, and the fleet is 500 over that. The estimate and the figures:
experiments/docs/continuous-sizing.md.

    python -m experiments.continuous_fleet
"""

from __future__ import annotations

import math

import numpy as np

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import FINISHED, replay
from batcher.sim.continuous.workload import Lengths, Workload
from experiments.common import write
from experiments.continuous_common import KV_BLOCKS_70B, two_scales

RATES = (16, 20, 24, 28, 32, 36)
SECONDS, LOAD, TTFT, TPOT = 30.0, 500, 1.0, 0.050


def run(rate: float) -> dict:
    model = ContinuousModelConfig(
        name="sim@1",
        simulated="llama-70b",
        workers=1,
        num_blocks=KV_BLOCKS_70B,
        max_batch_tokens=2048,
        max_seqs=256,
    )
    workload = Workload.synthetic(
        poisson(rate, SECONDS, 5),
        {"paid": 1.0},
        Lengths("fixed", 1500, 1500),
        Lengths("fixed", 300, 300),
        seed=5,
    )
    result = replay(workload, model, QueueConfig(tiers=("paid",), wait_budgets=(60.0,)), EngineSpec.of(model))
    out = result.outcomes
    done = out.outcome == FINISHED
    ttft = (out.first - out.sent)[done]
    tpot = ((out.end - out.first) / (out.tokens - 1))[done]
    p95 = float(np.percentile(ttft, 95)), float(np.percentile(tpot, 95))
    return {
        "req/s": rate,
        "TTFT p95 ms": round(p95[0] * 1000, 1),
        "TPOT p95 ms": round(p95[1] * 1000, 1),
        "meets both": p95[0] < TTFT and p95[1] < TPOT,
        "tok/s": round(result.replicas[0]["generated_tokens"] / result.virtual_seconds),
        "CPU s": round(result.cpu_seconds, 1),
    }


def main() -> None:
    rows = [run(rate) for rate in RATES]
    meeting = [r["req/s"] for r in rows if r["meets both"]]
    capacity = max(meeting) if meeting else float("nan")
    replicas = math.ceil(LOAD / capacity) if meeting else 0
    top = max(rows, key=lambda r: r["tok/s"])
    prefill = capacity * 1500 * 2 * 70e9 / (8 * 989e12)  # share of a replica's peak FLOP/s its prefill takes
    summary = (
        f"One replica meets TTFT p95 < 1 s and TPOT p95 < 50 ms up to {capacity} req/s of the rates tried, "
        "so "
        f"{LOAD} req/s takes {replicas} replicas, {8 * replicas} GPUs ({math.ceil(1.3 * replicas) * 8} "
        "with 30 % "
        f"headroom), against the estimate's ~350 (456). A saturated replica makes ~{top['tok/s']:,} "
        "tokens/s, close "
        "to the 9,000 the estimate assumes for decode, but what saturates it is prefill: at "
        f"{capacity} req/s the prompts alone take {prefill:.0%} of its peak FLOP/s. The estimate prices "
        "prefill at "
        "50 % of peak on GPUs of their own (212), twice what the cost model's roofline needs, and adds "
        "separate "
        "decode GPUs (136), while a colocated replica runs its decodes inside the same compute-bound steps. "
        "Disagrees, as a roofline must: plan with measured speeds (a cost model fitted to the real engine)."
    )
    figure = two_scales(
        [r["req/s"] for r in rows],
        [r["TTFT p95 ms"] for r in rows],
        [r["TPOT p95 ms"] for r in rows],
        xlabel="requests/s on one 70B replica",
        left_label="TTFT p95, ms",
        right_label="TPOT p95, ms",
        title="One 70B replica, 1,500 prompt + 300 answer tokens",
    )
    write("continuous_fleet", rows, figure, summary, "python -m experiments.continuous_fleet")


if __name__ == "__main__":
    main()
