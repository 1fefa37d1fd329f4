"""Settings of the fixed-batch core, as frozen dataclasses that check themselves.

Every bad value raises ``ValueError`` naming the field and the value, so a typo in a config file
or a command line reads as one clear line, not a traceback from deep inside the scheduler.
"""

from __future__ import annotations

import dataclasses
import math


def _require(condition: bool, field: str, expected: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueConfig:
    """How requests wait: tiers in priority order, their deadline, and aging of lower tiers."""

    tiers: tuple[str, ...] = ("paid", "free")
    queue_timeout: float = 30.0  # a request not dispatched this long after arrival: Overloaded
    age_limit: float = 1.0  # a lower-tier request this old is aged...
    aged_share: float = 0.1  # ...and aged requests may take this share of dispatched slots

    def __post_init__(self) -> None:
        _require(len(self.tiers) >= 1, "tiers", "at least one tier", self.tiers)
        _require(len(set(self.tiers)) == len(self.tiers), "tiers", "distinct names", self.tiers)
        _require(self.queue_timeout > 0, "queue_timeout", "seconds > 0", self.queue_timeout)
        _require(self.age_limit > 0, "age_limit", "seconds > 0", self.age_limit)
        _require(0.0 <= self.aged_share <= 1.0, "aged_share", "a share in 0..1", self.aged_share)

    def tier_index(self, name: str) -> int:
        """Position of a tier by name: 0 is served first."""
        try:
            return self.tiers.index(name)
        except ValueError:
            raise ValueError(f"tier: expected one of {list(self.tiers)}, got {name!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    """How many workers, and how the pool judges and repairs them."""

    workers: int = 8
    hang_timeout: float = 1.0  # a call running longer than this is a hung worker
    max_attempts: int = 3  # tries of one batch before it is split; of one input before it fails
    start_timeout: float = 120.0  # from spawn to `ready` (model load)
    restart_backoff: float = 0.1  # first wait before a restart; doubles on each failed start
    max_restart_backoff: float = 5.0

    def __post_init__(self) -> None:
        _require(1 <= self.workers <= 4096, "workers", "1..4096", self.workers)
        for name in ("hang_timeout", "start_timeout"):
            value = getattr(self, name)
            _require(0 < value < math.inf, name, "a finite number of seconds > 0", value)
        _require(1 <= self.max_attempts <= 16, "max_attempts", "1..16", self.max_attempts)
        _require(self.restart_backoff >= 0, "restart_backoff", "seconds >= 0", self.restart_backoff)
        _require(
            self.max_restart_backoff >= self.restart_backoff,
            "max_restart_backoff",
            f"seconds >= restart_backoff ({self.restart_backoff})",
            self.max_restart_backoff,
        )
