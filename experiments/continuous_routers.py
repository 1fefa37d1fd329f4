"""L6: where the router's prefix affinity bound should sit, on a chat trace.

Four 70B replicas (8 x H100 each), conversations of 12 turns (300 new prompt tokens and 200
answer tokens a turn), through the production pool and router (``batcher/continuous/router.py``),
at bounds from 0 (least queued tokens, the holder winning only ties) to unbounded (always the
holder). Load skew is the busiest replica's generated tokens over the mean. The question and the
figures: experiments/docs/continuous-chat.md.

    python -m experiments.continuous_routers
"""

from __future__ import annotations

import numpy as np

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import FINISHED, replay
from batcher.sim.continuous.workload import Lengths, Workload
from experiments.common import write
from experiments.continuous_common import KV_BLOCKS_70B, two_scales

BOUNDS = (0, 512, 2_048, 8_192, 1 << 30)
RATE, SECONDS, REPLICAS = 10.0, 60.0, 4


def run(bound: int) -> dict:
    model = ContinuousModelConfig(
        name="sim@1",
        simulated="llama-70b",
        workers=REPLICAS,
        num_blocks=KV_BLOCKS_70B,
        max_batch_tokens=2048,
        affinity_bound=bound,
    )
    workload = Workload.synthetic(
        poisson(RATE, SECONDS, 3),
        {"paid": 1.0},
        Lengths("fixed", 300, 300),
        Lengths("fixed", 200, 200),
        turns=12,
        seed=3,
    )
    result = replay(workload, model, QueueConfig(tiers=("paid",), wait_budgets=(30.0,)), EngineSpec.of(model))
    out = result.outcomes
    done = out.outcome == FINISHED
    ttft = (out.first - out.sent)[done]
    generated = np.array([r["generated_tokens"] for r in result.replicas], dtype=float)
    queries = sum(r["prefix_queries"] for r in result.replicas)
    return {
        "affinity bound": "unbounded" if bound >= 1 << 30 else bound,
        "TTFT p50 ms": round(float(np.percentile(ttft, 50)) * 1000, 1),
        "TTFT p95 ms": round(float(np.percentile(ttft, 95)) * 1000, 1),
        "hit %": round(100 * sum(r["prefix_hits"] for r in result.replicas) / queries, 1),
        "load skew": round(float(generated.max() / generated.mean()), 2),
        "CPU s": round(result.cpu_seconds, 1),
    }


def main() -> None:
    rows = [run(bound) for bound in BOUNDS]
    best = min(rows, key=lambda r: r["TTFT p95 ms"])
    summary = (
        f"Four 70B replicas, 12-turn chats at {RATE:g} turns/s. Least queued tokens alone (bound 0): hit "
        "rate "
        f"{rows[0]['hit %']} %, TTFT p95 {rows[0]['TTFT p95 ms']} ms, skew {rows[0]['load skew']}. Always "
        "the holder: "
        f"hit rate {rows[-1]['hit %']} %, TTFT p95 {rows[-1]['TTFT p95 ms']} ms, skew "
        f"{rows[-1]['load skew']}. The "
        f"lowest TTFT p95 here is at bound {best['affinity bound']} ({best['TTFT p95 ms']} ms). At this "
        "load the "
        "replicas are far from full, so skew costs little and hits are what matter; a bound is what keeps "
        "the "
        "holder from being chosen once it is busier than the others by more than a prefill is worth."
    )
    figure = two_scales(
        [str(r["affinity bound"]) for r in rows],
        [r["TTFT p95 ms"] for r in rows],
        [r["hit %"] for r in rows],
        xlabel="affinity bound, queued tokens",
        left_label="TTFT p95, ms",
        right_label="prefix hit rate, %",
        title="Routing 12-turn chats over four 70B replicas",
        bars=True,
    )
    write("continuous_routers", rows, figure, summary, "python -m experiments.continuous_routers")


if __name__ == "__main__":
    main()
