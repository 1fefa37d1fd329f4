"""What a continuous replay did, in numbers and as a table. Pure: reads a
:class:`~batcher.sim.continuous.replay.Replayed` and computes percentiles and rates.

    TTFT   seconds from sending a request to its first token (queueing and prefill included)
    TPOT   seconds per output token after the first: (end - first token) / (tokens - 1)

By tier: those two at p50/p95/p99 and how requests ended (finished, shed at admission, expired
in the queue, failed). By replica: tokens generated per virtual second, engine steps, KV blocks
in use (mean and peak of the samples), preemptions, the prefix cache's hit rate (prompt tokens
it supplied over those looked up). In all: the tokens answered (prompt and answer tokens of the
finished requests), what a million of them cost at a GPU-hour price.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from batcher.core.cost import cost_per_million_tokens
from batcher.sim.continuous.replay import FINISHED, OUTCOMES, Replayed

PERCENTILES = (50, 95, 99)


def percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {f"p{p}": float("nan") for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=False)}


@dataclasses.dataclass(frozen=True)
class TierReport:
    requests: int
    ended: dict[str, int]  # finished, shed, expired, failed
    ttft: dict[str, float]
    tpot: dict[str, float]


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    tokens_per_second: float
    steps: int
    kv_mean: float
    kv_peak: float
    preemptions: int
    prefix_hit_rate: float


@dataclasses.dataclass(frozen=True)
class ContinuousReport:
    """The numbers of one replay (see the module doc)."""

    requests: int
    virtual_seconds: float
    cpu_seconds: float
    by_tier: dict[str, TierReport]
    replicas: list[ReplicaReport]
    tokens: int  # prompt and answer tokens of the finished requests: what is billed

    @classmethod
    def of(cls, run: Replayed) -> ContinuousReport:
        workload, out = run.workload, run.outcomes
        ttft = out.first - out.sent
        tokens = np.maximum(out.tokens - 1, 1)
        tpot = np.where(out.tokens > 1, (out.end - out.first) / tokens, np.nan)
        finished = out.outcome == FINISHED
        by_tier = {}
        for index, name in enumerate(workload.tiers):
            mine = workload.tier == index
            done = mine & finished
            ended = {o: int((mine & (out.outcome == code)).sum()) for code, o in enumerate(OUTCOMES) if code}
            by_tier[name] = TierReport(
                int(mine.sum()), ended, percentiles(ttft[done]), percentiles(tpot[done & ~np.isnan(tpot)])
            )
        span = max(run.virtual_seconds, 1e-9)
        replicas = []
        for slot, counters in enumerate(run.replicas):
            kv = run.kv_use[:, slot] if len(run.kv_use) else np.zeros(1)
            queries = counters["prefix_queries"]
            replicas.append(
                ReplicaReport(
                    counters["generated_tokens"] / span,
                    counters["steps"],
                    float(kv.mean()),
                    float(kv.max()),
                    counters["preemptions"],
                    counters["prefix_hits"] / queries if queries else 0.0,
                )
            )
        answered = int(workload.prompt[finished].sum() + out.tokens[finished].sum())
        return cls(len(workload), run.virtual_seconds, run.cpu_seconds, by_tier, replicas, answered)

    def cost_per_million_tokens(self, replica_hour_price: float) -> float:
        """What a million of its tokens cost with every replica held for the whole replay."""
        rate = self.tokens / max(self.virtual_seconds, 1e-9)
        return cost_per_million_tokens(replica_hour_price, len(self.replicas), rate)

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.replicas)

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "steps": self.steps,
            "requests_per_cpu_second": self.requests / max(self.cpu_seconds, 1e-9),
            "steps_per_cpu_second": self.steps / max(self.cpu_seconds, 1e-9),
        }

    def table(self) -> str:
        ms = 1000.0
        lines = [
            f"{'tier':<8}{'requests':>9}{'finished':>9}{'shed':>7}{'expired':>8}{'failed':>7}   "
            + "TTFT p50/p95/p99 ms        TPOT p50/p95/p99 ms"
        ]
        for name, tier in self.by_tier.items():
            e = tier.ended
            ttft = "/".join(f"{tier.ttft[f'p{p}'] * ms:.0f}" for p in PERCENTILES)
            tpot = "/".join(f"{tier.tpot[f'p{p}'] * ms:.1f}" for p in PERCENTILES)
            lines.append(
                f"{name:<8}{tier.requests:>9}{e['finished']:>9}{e['shed']:>7}{e['expired']:>8}"
                f"{e['failed']:>7}   {ttft:<26} {tpot}"
            )
        lines.append(
            f"{'replica':<8}{'tok/s':>9}{'steps':>9}{'KV mean':>9}{'KV peak':>9}{'preempt':>9}"
            f"{'prefix hits':>13}"
        )
        for slot, r in enumerate(self.replicas):
            lines.append(
                f"{slot:<8}{r.tokens_per_second:>9,.0f}{r.steps:>9,}{r.kv_mean:>9.0%}{r.kv_peak:>9.0%}"
                f"{r.preemptions:>9,}{r.prefix_hit_rate:>13.1%}"
            )
        return "\n".join(lines)
