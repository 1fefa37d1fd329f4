"""What a load run did, in numbers and as a table: rates, latency percentiles, batches, errors.

Pure: it reads finished requests and the batcher's counters, and computes nothing that depends
on how the run was driven (real processes or virtual time), so both are reported alike.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from batcher.fixed.counters import BatchCounters
from batcher.fixed.request import Request, RequestState

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
    def of(cls, seconds: Sequence[float] | np.ndarray) -> Latency:
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
    errors: dict[str, int]  # error type -> requests that ended with it (dropped, with the reason)
    mean_batch: float
    flushes: dict[str, int]
    calls: int
    restarts: int
    retries: int
    driver_lag: float  # worst delay between a scheduled arrival and its offer
    dropped_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    busy_fraction: float = float("nan")  # time workers spent in calls / (workers x run span)

    @property
    def dropped(self) -> int:
        return self.offered - self.completed

    def as_dict(self) -> dict:
        """Plain values for JSON: NaN (no sample) becomes None."""
        return _no_nan(dataclasses.asdict(self))

    def table(self) -> str:
        """The report as an aligned text table, times in milliseconds."""
        ms = 1000.0
        rows = [
            ("offered", f"{self.offered} requests at {self.offered_rate:,.0f}/s"),
            ("achieved", f"{self.completed} outputs at {self.achieved_rate:,.0f}/s"),
            ("dropped", f"{self.dropped}" + "".join(f"  {k}: {v}" for k, v in sorted(self.errors.items()))),
            *[
                (f"latency {name}", f"p50 {t.p50 * ms:.0f}  p95 {t.p95 * ms:.0f}  p99 {t.p99 * ms:.0f}  "
                 f"max {t.max * ms:.0f} ms  ({t.count} served, {dropped} dropped)")
                for name, t, dropped in [
                    ("all", self.latency, self.dropped),
                    *[(tier, t, self.dropped_by_tier.get(tier, 0)) for tier, t in self.by_tier.items()],
                ]
            ],
            ("mean batch", f"{self.mean_batch:.1f}"),
            ("GPU busy", f"{self.busy_fraction:.1%}"),
            ("flushes", ", ".join(f"{k}: {v}" for k, v in sorted(self.flushes.items())) or "none"),
            ("worker calls", f"{self.calls} (retries {self.retries}, restarts {self.restarts})"),
            ("driver lag", f"{self.driver_lag * ms:.1f} ms"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _no_nan(value):
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Samples:
    """Arrival (s), tier index, latency (s, NaN if dropped) and served flag of each request."""

    arrival: np.ndarray
    tier: np.ndarray
    latency: np.ndarray
    served: np.ndarray


class Recorder:
    """Collects outcomes as requests end, into arrays: a run of millions keeps no Request alive.

    Use it as the requests' ``on_done``. ``capacity`` bounds the number of requests recorded.
    """

    def __init__(self, capacity: int) -> None:
        self.ended = 0
        self._latency = np.full(capacity, np.nan)
        self._arrival = np.zeros(capacity)
        self._tier = np.zeros(capacity, dtype=np.int16)
        self._served = np.zeros(capacity, dtype=bool)
        self.errors: collections.Counter[str] = collections.Counter()
        self.first_arrival = self.last_arrival = float("nan")
        self.last_output = float("-inf")

    def __call__(self, request: Request) -> None:
        index = self.ended
        self.ended += 1
        self._tier[index] = request.tier
        arrival = self._arrival[index] = request.arrival
        if not arrival >= self.first_arrival:  # also true while it is NaN
            self.first_arrival = arrival
        if not arrival <= self.last_arrival:
            self.last_arrival = arrival
        if request.state is RequestState.DONE:
            finished = request.finished_at
            assert finished is not None, "a done request has ended"
            self._served[index] = True
            self._latency[index] = finished - arrival
            if finished > self.last_output:
                self.last_output = finished
        else:
            self.errors[type(request.error).__name__ if request.error else request.state.value] += 1

    def samples(self) -> Samples:
        """Per request, in the order they ended: for plots over time."""
        n = self.ended
        return Samples(self._arrival[:n], self._tier[:n], self._latency[:n], self._served[:n])

    def report(
        self, tiers: Sequence[str], counters: BatchCounters, workers: int | None = None,
        driver_lag: float = 0.0,
    ) -> Report:
        """Summarise the requests recorded so far (all of a run, once every one has ended)."""
        if not self.ended:
            raise ValueError("summarize: the run offered no request")
        served, tier = self._served[: self.ended], self._tier[: self.ended]
        latency = self._latency[: self.ended]
        window = self.last_arrival - self.first_arrival
        span = max(self.last_output, self.first_arrival) - self.first_arrival
        present = [(i, name) for i, name in enumerate(tiers) if (tier == i).any()]
        return Report(
            offered=self.ended,
            offered_rate=(self.ended - 1) / window if window > 0 else float("nan"),
            completed=int(served.sum()),
            achieved_rate=int(served.sum()) / span if span > 0 else float("nan"),
            latency=Latency.of(latency[served]),
            by_tier={name: Latency.of(latency[served & (tier == i)]) for i, name in present},
            errors=dict(self.errors),
            mean_batch=counters.mean_batch,
            flushes=dict(counters.flushes),
            calls=counters.calls,
            restarts=counters.restarts,
            retries=counters.retries,
            driver_lag=driver_lag,
            dropped_by_tier={name: int((~served & (tier == i)).sum()) for i, name in present},
            busy_fraction=counters.busy_seconds / (workers * span) if workers and span > 0 else float("nan"),
        )


def summarize(
    requests: Sequence[Request],
    tiers: Sequence[str],
    counters: BatchCounters,
    driver_lag: float = 0.0,
    workers: int | None = None,
) -> Report:
    """Summarise a finished run; every request must have ended."""
    recorder = Recorder(len(requests))
    for request in requests:
        recorder(request)
    return recorder.report(tiers, counters, workers, driver_lag)
