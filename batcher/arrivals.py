"""Arrival processes for load generators and simulations: pure functions of a seed.

They return arrival times in seconds from the start of a run as a numpy array, so a generator
of millions of requests costs one vectorised call, and the same seed gives the same trace in
virtual time and against real workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def poisson(rate: float, duration: float, seed: int = 0) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate`` per second over ``[0, duration)``."""
    if rate <= 0:
        raise ValueError(f"rate: expected requests per second > 0, got {rate}")
    if duration <= 0:
        raise ValueError(f"duration: expected seconds > 0, got {duration}")
    rng = np.random.default_rng(seed)
    expected = rate * duration
    times = np.cumsum(rng.exponential(1.0 / rate, int(expected + 10 * expected**0.5 + 10)))
    return times[times < duration]


def tier_mix(count: int, shares: dict[str, float], seed: int = 0) -> list[str]:
    """``count`` tier names drawn independently with the given shares (normalised)."""
    names: Sequence[str] = list(shares)
    weights = np.array([shares[name] for name in names], dtype=float)
    if len(names) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"tier mix: expected non-negative shares with a positive sum, got {shares}")
    picks = np.random.default_rng(seed + 1).choice(len(names), size=count, p=weights / weights.sum())
    return [names[i] for i in picks]
