"""L5: prefix caching for chat, on 70B replicas on 8 x H100.

Part one: a 12th turn alone on an idle replica, its history cached or not (a tenant of its own
salts its hashes, so nothing it asks is found). Part two: a chat workload (conversations of 12
turns, 300 new tokens and 450 answer tokens a turn) through the production router and pool on two
replicas, with the cache and without; then with the cache on caches of shrinking size, where a
conversation's history is evicted between its turns: the hit rate under KV pressure. The claim
and the figures: experiments/docs/continuous-chat.md.

    python -m experiments.continuous_prefix_chat
"""

from __future__ import annotations

import numpy as np

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import FINISHED, replay
from batcher.sim.continuous.report import ContinuousReport
from batcher.sim.continuous.workload import Lengths, Workload
from experiments.common import write
from experiments.continuous_common import KV_BLOCKS_70B, Replica, two_scales

NEW, ANSWER, TURNS = 300, 450, 12
HISTORY = (TURNS - 1) * (NEW + ANSWER)  # 8,250 tokens before the 12th turn's new ones
RATE, SECONDS = 6.0, 120.0


def twelfth_turn(cached: bool) -> float:
    """TTFT of the 12th turn on an idle replica that served the 11th."""
    replica = Replica()
    eleventh = replica.add(HISTORY - ANSWER, answer=ANSWER)
    prompt = list(replica.engine.scheduler.sequences[eleventh].prompt_ids)
    while replica.engine.has_work:
        output, _ = replica.step()
        if eleventh in output.tokens:
            prompt.append(output.tokens[eleventh])
    prompt += [5 + i for i in range(NEW)]
    start = replica.now
    rid = replica.add(prompt, answer=1, tenant="" if cached else "another")
    while rid not in replica.step()[0].tokens:
        pass
    return replica.now - start


def chat(blocks: int, cache: bool) -> dict:
    model = ContinuousModelConfig(
        name="sim@1", simulated="llama-70b", workers=2, num_blocks=blocks, max_batch_tokens=2048, max_seqs=256
    )
    workload = Workload.synthetic(
        poisson(RATE, SECONDS, 1),
        {"paid": 1.0},
        Lengths("fixed", NEW, NEW),
        Lengths("fixed", ANSWER, ANSWER),
        turns=TURNS,
        seed=1,
    )
    run = replay(
        workload,
        model,
        QueueConfig(tiers=("paid",), wait_budgets=(30.0,)),
        EngineSpec.of(model),
        prefix_cache=cache,
    )
    report = ContinuousReport.of(run)
    out = run.outcomes
    done = out.outcome == FINISHED
    ttft = (out.first - out.sent)[done]
    queries = sum(r["prefix_queries"] for r in run.replicas)
    return {
        "KV blocks per replica": blocks,
        "prefix cache": "on" if cache else "off",
        "requests": len(workload),
        "finished": int(done.sum()),
        "TTFT p50 ms": round(float(np.percentile(ttft, 50)) * 1000, 1),
        "TTFT p95 ms": round(float(np.percentile(ttft, 95)) * 1000, 1),
        # every step's tokens, less the decodes (each sampled token but a sequence's first came from one)
        "prefill tokens": sum(r["computed_tokens"] - r["generated_tokens"] for r in run.replicas)
        + int(done.sum()),
        "hit %": round(100 * sum(r["prefix_hits"] for r in run.replicas) / queries, 1) if queries else 0.0,
        "tok/s per replica": round(sum(r.tokens_per_second for r in report.replicas) / 2),
        "CPU s": round(run.cpu_seconds, 1),
    }


def main() -> None:
    cold, warm = twelfth_turn(cached=False), twelfth_turn(cached=True)
    rows = [chat(KV_BLOCKS_70B, cache=False), chat(KV_BLOCKS_70B, cache=True)]
    rows += [chat(blocks, cache=True) for blocks in (8_000, 4_000, 2_000)]
    off, on = rows[0], rows[1]
    pressure = ", ".join(f"{r['hit %']:.0f}% at {r['KV blocks per replica']:,} blocks" for r in rows[2:])
    summary = (
        f"The 12th turn alone ({HISTORY + NEW:,} prompt tokens, {NEW} new): first token after "
        f"{cold * 1000:,.0f} ms "
        f"without the cache, {warm * 1000:,.1f} ms with it (the claim: ~0.3 s at 500 TFLOP/s a GPU, ~10 "
        "ms; here "
        "the cost model's 989 TFLOP/s and the attention over the history give these). Through the router "
        "and pool "
        f"at {RATE:g} turns/s on two replicas: TTFT p50 {off['TTFT p50 ms']} ms without the cache, "
        f"{on['TTFT p50 ms']} ms with it (p95 {off['TTFT p95 ms']} against {on['TTFT p95 ms']}), hit rate "
        f"{on['hit %']:.0f}%; the prompt tokens the replicas prefilled fall from {off['prefill tokens']:,} "
        "to "
        f"{on['prefill tokens']:,}. Agrees. Under KV pressure the hit rate falls as the histories of "
        f"conversations between turns are evicted: {pressure}."
    )
    figure = two_scales(
        [f"{r['prefix cache']}\n{r['KV blocks per replica']:,}" for r in rows],
        [r["TTFT p50 ms"] for r in rows],
        [r["hit %"] for r in rows],
        xlabel="prefix cache, KV blocks per replica",
        left_label="TTFT p50, ms",
        right_label="prefix hit rate, %",
        title="Chat of 12 turns on two 70B replicas: prefix caching",
        bars=True,
    )
    write("continuous_prefix_chat", rows, figure, summary, "python -m experiments.continuous_prefix_chat")


if __name__ == "__main__":
    main()
