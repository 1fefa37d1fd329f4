"""Arrival processes for load generators and simulations: pure functions of a seed.

They return arrival times in seconds from the start of a run as a numpy array, so a generator
of millions of requests costs one vectorised call, and the same seed gives the same trace in
virtual time and against real workers. A :class:`Trace` adds each arrival's tier and optional
deadline, and reads and writes the CSV form a user replays through ``ferry simulate``::

    timestamp,tier,deadline
    0.000,paid,0.500
    0.013,free,
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence

import numpy as np


def _check_duration(duration: float) -> None:
    if not 0 < duration < math.inf:
        raise ValueError(f"duration: expected seconds > 0, got {duration}")


def poisson(rate: float, duration: float, seed: int = 0) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate`` per second over ``[0, duration)``."""
    if rate <= 0:
        raise ValueError(f"rate: expected requests per second > 0, got {rate}")
    _check_duration(duration)
    rng = np.random.default_rng(seed)
    expected = rate * duration
    times = np.cumsum(rng.exponential(1.0 / rate, int(expected + 10 * expected**0.5 + 10)))
    return times[times < duration]


def piecewise(segments: Sequence[tuple[float, float]], seed: int = 0) -> np.ndarray:
    """Poisson arrivals whose rate changes: ``segments`` are ``(seconds, rate)`` in order.

    A rate of 0 is a quiet spell. ``[(10, 1000), (5, 6000), (15, 1000)]`` is a 5 s burst of
    three times the capacity of 8 reference GPUs between two stretches at half of it.
    """
    parts, start = [], 0.0
    for index, (seconds, rate) in enumerate(segments):
        _check_duration(seconds)
        if rate < 0:
            raise ValueError(f"segments[{index}] rate: expected requests per second >= 0, got {rate}")
        if rate > 0:
            parts.append(start + poisson(rate, seconds, seed + 7919 * index))
        start += seconds
    return np.concatenate(parts) if parts else np.empty(0)


def bursty(base: float, peak: float, on: float, off: float, duration: float, seed: int = 0) -> np.ndarray:
    """On/off arrivals: ``off`` seconds at ``base`` per second, then ``on`` seconds at ``peak``, repeated."""
    _check_duration(duration)
    segments, start = [], 0.0
    while start < duration:
        for seconds, rate in ((off, base), (on, peak)):
            seconds = min(seconds, duration - start)
            if seconds > 0:
                segments.append((seconds, rate))
                start += seconds
    return piecewise(segments, seed)


def tier_picks(count: int, shares: dict[str, float], seed: int = 0) -> np.ndarray:
    """``count`` indices into ``list(shares)``, drawn independently with the given shares."""
    weights = np.array(list(shares.values()), dtype=float)
    if len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"tier mix: expected non-negative shares with a positive sum, got {shares}")
    picks = np.random.default_rng(seed + 1).choice(len(weights), size=count, p=weights / weights.sum())
    return picks.astype(np.int8)


def tier_mix(count: int, shares: dict[str, float], seed: int = 0) -> list[str]:
    """``count`` tier names drawn independently with the given shares (normalised)."""
    names = list(shares)
    return [names[i] for i in tier_picks(count, shares, seed)]


@dataclasses.dataclass(frozen=True)
class Trace:
    """Arrivals to replay: times (s from the start), a tier index each, deadlines (NaN: none).

    ``tiers`` names the tiers the indices point at; a deadline is an absolute time on the same
    clock as the arrivals (the time the answer is due).
    """

    times: np.ndarray
    tier: np.ndarray
    deadlines: np.ndarray
    tiers: tuple[str, ...]

    def __post_init__(self) -> None:
        if not (len(self.times) == len(self.tier) == len(self.deadlines)):
            raise ValueError("trace: times, tier and deadlines must have one entry per arrival")
        if len(self.times) and (np.diff(self.times) < 0).any():
            raise ValueError("trace: arrival times must not decrease")

    def __len__(self) -> int:
        return len(self.times)

    @classmethod
    def of(
        cls, times: np.ndarray, shares: dict[str, float], seed: int = 0, budget: float | None = None
    ) -> Trace:
        """Tiers drawn with ``shares``; every arrival due ``budget`` seconds after it, if given."""
        deadlines = np.full(len(times), np.nan) if budget is None else times + budget
        return cls(times, tier_picks(len(times), shares, seed), deadlines, tuple(shares))

    def write(self, path: str) -> None:
        with open(path, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["timestamp", "tier", "deadline"])
            for time, tier, deadline in zip(self.times, self.tier, self.deadlines, strict=False):
                writer.writerow(
                    [f"{time:.6f}", self.tiers[tier], "" if math.isnan(deadline) else f"{deadline:.6f}"]
                )

    @classmethod
    def read(cls, path: str, tiers: Sequence[str]) -> Trace:
        """Read a CSV trace (header ``timestamp,tier[,deadline]``); times are shifted to start at 0.

        Rows are sorted by timestamp; a tier not in ``tiers`` is an error naming the line.
        """
        index = {name: i for i, name in enumerate(tiers)}
        times, tier, deadlines = [], [], []
        with open(path, newline="") as source:
            reader = csv.DictReader(source)
            if reader.fieldnames is None or not {"timestamp", "tier"} <= set(reader.fieldnames):
                raise ValueError(
                    f"{path}: expected a header with timestamp,tier[,deadline], got {reader.fieldnames}"
                )
            for row in reader:
                line = reader.line_num
                try:
                    times.append(float(row["timestamp"]))
                    deadlines.append(float(row.get("deadline") or "nan"))
                except ValueError as exc:
                    raise ValueError(f"{path}:{line}: {exc}") from None
                if row["tier"] not in index:
                    raise ValueError(
                        f"{path}:{line}: tier: expected one of {list(tiers)}, got {row['tier']!r}"
                    )
                tier.append(index[row["tier"]])
        if not times:
            raise ValueError(f"{path}: the trace has no arrival")
        order = np.argsort(times, kind="stable")
        start = min(times)
        return cls(
            np.asarray(times)[order] - start,
            np.asarray(tier, dtype=np.int8)[order],
            np.asarray(deadlines)[order] - start,
            tuple(tiers),
        )
