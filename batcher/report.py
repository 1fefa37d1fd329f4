"""What a load run did, in numbers and as a table: rates, latency percentiles, batches, errors.

Pure: it reads finished requests and the batcher's counters, and computes nothing that depends
on how the run was driven (real processes or virtual time), so both are reported alike.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from batcher.stats import Stats
from batcher.types import Request, State

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass(frozen=True, slots=True)
class Latency:
    """Seconds from arrival to output, over the requests that got one."""

    count: int
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        if not len(seconds):
            return cls(0, *([float("nan")] * 4))
        p50, p95, p99 = np.percentile(seconds, PERCENTILES)
        return cls(len(seconds), float(p50), float(p95), float(p99), float(np.max(seconds)))


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    offered: int
    offered_rate: float  # requests per second over the arrival window
    completed: int
    achieved_rate: float  # outputs per second, first arrival to last output
    latency: Latency
    by_tier: dict[str, Latency]
    errors: dict[str, int]  # error type -> requests that ended with it
    mean_batch: float
    flushes: dict[str, int]
    calls: int
    restarts: int
    retries: int
    driver_lag: float  # worst delay between a scheduled arrival and its offer

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The report as an aligned text table, times in milliseconds."""
        ms = 1000.0
        rows = [
            ("offered", f"{self.offered} requests at {self.offered_rate:,.0f}/s"),
            ("achieved", f"{self.completed} outputs at {self.achieved_rate:,.0f}/s"),
            ("errors", ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"),
            *[
                (f"latency {name}", f"p50 {t.p50 * ms:.0f}  p95 {t.p95 * ms:.0f}  p99 {t.p99 * ms:.0f}  "
                 f"max {t.max * ms:.0f} ms  ({t.count})")
                for name, t in [("all", self.latency), *self.by_tier.items()]
            ],
            ("mean batch", f"{self.mean_batch:.1f}"),
            ("flushes", ", ".join(f"{k}: {v}" for k, v in sorted(self.flushes.items())) or "none"),
            ("worker calls", f"{self.calls} (retries {self.retries}, restarts {self.restarts})"),
            ("driver lag", f"{self.driver_lag * ms:.1f} ms"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def summarize(requests: Sequence[Request], tiers: Sequence[str], stats: Stats, driver_lag: float = 0.0) -> Report:
    """Summarise a finished run; every request must have ended."""
    if not requests:
        raise ValueError("summarize: the run offered no request")
    arrivals = [r.arrival for r in requests]
    served = [r for r in requests if r.state is State.DONE]
    errors = collections.Counter(
        type(r.error).__name__ if r.error else r.state.value for r in requests if r.state is not State.DONE
    )
    window = max(arrivals) - min(arrivals)
    span = max((r.finished_at for r in served), default=min(arrivals)) - min(arrivals)
    by_tier = {
        name: Latency.of([r.finished_at - r.arrival for r in served if r.tier == index])
        for index, name in enumerate(tiers)
        if any(r.tier == index for r in requests)
    }
    return Report(
        offered=len(requests),
        offered_rate=(len(requests) - 1) / window if window > 0 else float("nan"),
        completed=len(served),
        achieved_rate=len(served) / span if span > 0 else float("nan"),
        latency=Latency.of([r.finished_at - r.arrival for r in served]),
        by_tier=by_tier,
        errors=dict(errors),
        mean_batch=stats.mean_batch,
        flushes=dict(stats.flushes),
        calls=stats.calls,
        restarts=stats.restarts,
        retries=stats.retries,
        driver_lag=driver_lag,
    )
