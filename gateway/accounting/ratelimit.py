"""Per-key limits as token buckets: the pure arithmetic every limiter store shares.

A key's plan allows so many tokens (and requests) per minute. At admission the gateway charges
``input_tokens + max_tokens``, the most the request can cost, and refunds the unused part when
it ends. A bucket holds one minute of budget and refills at ``limit / 60`` per second. A charge
that does not fit takes nothing and says when it would: ``(amount - level) / rate`` seconds, the
429's ``Retry-After``; one larger than a whole bucket never fits (``retry_after`` infinite: a
400). Everything is a function of the state, the amounts and ``now``; the stores (memory,
Redis) only keep the state, and Redis runs the same arithmetic in a Lua script, which the tests
check gives the same verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """A key's plan: tokens and requests per minute (None: unlimited)."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")

    @property
    def unlimited(self) -> bool:
        """No limit in either dimension: there is nothing to charge."""
        return self.tokens_per_minute is None and self.requests_per_minute is None

    @property
    def capacities(self) -> tuple[float, float]:
        """The bucket sizes, tokens first; an unlimited dimension is an infinite bucket."""
        return (
            math.inf if self.tokens_per_minute is None else float(self.tokens_per_minute),
            math.inf if self.requests_per_minute is None else float(self.requests_per_minute),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """How full a bucket was at ``updated`` (seconds on the limiter's clock)."""

    level: float
    updated: float


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of a charge: admitted, or how long until the same charge would fit; and the
    buckets' levels after it (tokens, requests; inf where unlimited), which the rate-limit
    headers show (None: the store cannot say, as a lease served from its slice)."""

    admitted: bool
    retry_after: float = 0.0  # seconds; inf when the charge can never fit
    levels: tuple[float, float] | None = None

    @property
    def never(self) -> bool:
        return math.isinf(self.retry_after)


def full(capacity: float, now: float) -> Bucket:
    """A bucket nobody has drawn from yet."""
    return Bucket(capacity, now)


def level_at(bucket: Bucket, capacity: float, now: float) -> float:
    """The bucket's level at ``now``: refilled at capacity/60 per second, never above capacity."""
    if math.isinf(capacity):
        return math.inf
    elapsed = max(0.0, now - bucket.updated)
    return min(capacity, bucket.level + elapsed * capacity / 60.0)


def charge(
    buckets: tuple[Bucket, ...], capacities: tuple[float, ...], amounts: tuple[float, ...], now: float
) -> tuple[Verdict, tuple[Bucket, ...]]:
    """Take ``amounts`` from every bucket at once, or from none; return the verdict and new state."""
    levels = [level_at(b, c, now) for b, c in zip(buckets, capacities, strict=True)]
    kept = tuple(Bucket(level, now) for level in levels)
    if any(amount > capacity for amount, capacity in zip(amounts, capacities, strict=False)):
        return Verdict(False, math.inf, (levels[0], levels[1])), kept
    short = [
        (amount - level) / (capacity / 60.0)
        for amount, level, capacity in zip(amounts, levels, capacities, strict=False)
        if amount > level
    ]
    if short:
        return Verdict(False, max(short), (levels[0], levels[1])), kept
    left = tuple(level - amount for level, amount in zip(levels, amounts, strict=False))
    return Verdict(True, 0.0, (left[0], left[1])), tuple(Bucket(level, now) for level in left)


def refund(bucket: Bucket, capacity: float, amount: float, now: float) -> Bucket:
    """Give back part of a charge that was not used; the bucket never overflows its capacity."""
    return Bucket(min(capacity, level_at(bucket, capacity, now) + amount), now)


class Limiter(Protocol):
    """A store of buckets (in memory, in Redis, leased, or Redis with a local fallback)."""

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        """Charge a request's worst-case cost, all or nothing."""

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        """Give back what a request did not use."""

    async def aclose(self) -> None:
        """Let go of connections and return leased budget (the gateway is stopping)."""
