"""L9: prefill/decode disaggregation against colocated replicas, as prompts grow.

The same 8 replicas of 70B on 8 x H100, answers of 200 tokens, targets TTFT p95 < 2 s and TPOT
p95 < 50 ms. Replayed: a colocated replica (chunked prefill at 2,048 tokens a step beside the
decodes, :mod:`experiments.continuous_drive`) and a prefill replica (one token a request, 8,192
tokens a step, its TTFT plus the KV transfer under 2 s). Modelled: the KV transfer (prompt x 320
KiB over 50 GB/s), the decode replica from the cost model (the largest steady batch B with a step
under 50 ms serves B / (s(B) x 200) requests/s), and the best split of p prefill and 8 - p decode
replicas. The claim and the figures: experiments/docs/continuous-disaggregation.md.
``--link-gbps`` sets the transfer's rate (the hand-off between ferry's engines measures its own:
``experiments/kv_handoff_cost.py``).

    python -m experiments.continuous_disagg [--link-gbps 50]
"""

from __future__ import annotations

import argparse
import sys

from batcher.sim.arrivals import poisson
from experiments.common import plt, write
from experiments.continuous_common import KV_BLOCKS_70B, SEVENTY_B, Replica
from experiments.continuous_drive import CONTINUOUS, drive, refine, sweep

PROMPTS, ANSWER, REPLICAS, GPUS = (500, 2_000, 8_000, 32_000), 200, 8, 8
TTFT, TPOT, MAX_SEQS = 2.0, 0.050, 256
KV_TOKENS = KV_BLOCKS_70B * 16
REQUESTS, SECONDS = 150, 20.0
STEPS = (0.3, 0.5, 0.65, 0.8, 0.9, 1.0, 1.1)  # rates tried, as shares of the prefill bound


def transfer(prompt: int, link: float) -> float:
    """Seconds to move a prompt's KV over a link of ``link`` bytes a second."""
    return prompt * SEVENTY_B.shape.kv_bytes_per_token / link


def served(prompt: int, answer: int, rate: float, budget: int) -> tuple[float, float]:
    """TTFT and TPOT p95 of Poisson ``rate`` on one replica with a step budget of ``budget``."""
    times = poisson(rate, max(REQUESTS / rate, SECONDS), 9)
    replica = Replica(max_batch_tokens=budget)
    return drive(replica, times, [prompt] * len(times), [answer] * len(times), CONTINUOUS).p95()


def replayed_capacity(prompt: int, answer: int, budget: int, extra: float) -> float:
    """Highest rate (of shares of the prefill bound) whose TTFT p95 + ``extra`` and TPOT p95 meet."""
    bound = 1 / SEVENTY_B.step([prompt], [prompt]).seconds

    def run(rate: float) -> dict:
        ttft, tpot = served(prompt, answer, rate, budget)
        return {"req/s": rate, "ok": ttft + extra < TTFT and tpot < TPOT}

    def ok(row: dict) -> bool:
        return row["ok"]

    return refine(run, sweep(run, [bound * share for share in STEPS], ok), ok)


def decode_capacity(prompt: int) -> tuple[float, int]:
    """Requests/s one decode replica serves within the TPOT target, and its batch (the model)."""
    context, best = prompt + ANSWER // 2, (0.0, 0)
    for batch in range(1, MAX_SEQS + 1):
        step = SEVENTY_B.step([1] * batch, [context] * batch).seconds
        if step >= TPOT or batch * (prompt + ANSWER) > KV_TOKENS:
            break
        best = (batch / (step * ANSWER), batch)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=50.0, help="the KV transfer's GB/s (default 50)")
    args = parser.parse_args(argv)
    link = args.link_gbps * 1e9
    rows = []
    for prompt in PROMPTS:
        colocated = REPLICAS * replayed_capacity(prompt, ANSWER, 2048, 0.0)
        prefill = replayed_capacity(prompt, 1, 8192, transfer(prompt, link))
        decode, batch = decode_capacity(prompt)
        split = max(range(1, REPLICAS), key=lambda p: min(p * prefill, (REPLICAS - p) * decode))
        disagg = min(split * prefill, (REPLICAS - split) * decode)
        rows.append(
            {
                "prompt": prompt,
                "colocated req/s": round(colocated, 1),
                "prefill replica req/s": round(prefill, 2),
                "decode replica req/s": round(decode, 1),
                "decode batch": batch,
                "KV transfer ms": round(transfer(prompt, link) * 1000, 1),
                "best split P:D": f"{split}:{REPLICAS - split}",
                "disaggregated req/s": round(disagg, 1),
                "disagg / colocated": round(disagg / colocated, 2) if colocated else float("nan"),
            }
        )
    wins = [r["prompt"] for r in rows if r["disagg / colocated"] > 1]
    summary = (
        f"{REPLICAS} replicas of 70B on 8 x H100 ({REPLICAS * GPUS} GPUs), {ANSWER}-token answers, KV moved "
        f"at {args.link_gbps:g} GB/s, goodput "
        f"within TTFT p95 < {TTFT:g} s and TPOT p95 < {TPOT * 1000:g} ms. "
        + "; ".join(
            f"{r['prompt']:,}-token prompts: colocated {r['colocated req/s']:g} req/s, split "
            f"{r['best split P:D']} {r['disaggregated req/s']:g} (x{r['disagg / colocated']:g})"
            for r in rows
        )
        + ". "
        + (
            f"Disaggregation wins from {min(wins):,}-token prompts on."
            if wins
            else "Colocated wins at every prompt length tried."
        )
    )
    figure, axis = plt.subplots(figsize=(7, 4))
    for name in ("colocated req/s", "disaggregated req/s"):
        axis.plot([r["prompt"] for r in rows], [r[name] / (REPLICAS * GPUS) for r in rows], "o-", label=name)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("prompt tokens (answers of 200)")
    axis.set_ylabel("goodput, req/s per GPU")
    axis.set_title("Prefill/decode disaggregation against colocated, 64 GPUs of 70B")
    axis.legend()
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m experiments.continuous_disagg", *given])
    write("continuous_disagg", rows, figure, summary, command)


if __name__ == "__main__":
    main()
