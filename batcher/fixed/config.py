"""A fixed-mode model table: its ``run_batch`` workers and the batching in front of them."""

from __future__ import annotations

import dataclasses
import math

from batcher.core.config import ModelConfig, PoolConfig, require
from batcher.fixed.policy import POLICIES, Policy, make_policy


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FixedModelConfig(ModelConfig):
    """A fixed-mode model: ``run_batch`` workers and the batching in front of them."""

    mode: str = "fixed"
    worker: tuple[str, ...]
    workers: int = 8
    max_batch: int = 50
    max_wait_ms: float = 150.0
    hang_timeout_ms: float = 1000.0
    max_attempts: int = 3
    policy: str = "size_or_timeout"  # a name in batcher.fixed.policy.POLICIES
    policy_options: dict[str, float] = dataclasses.field(default_factory=dict)  # its own parameters

    def __post_init__(self) -> None:
        super(FixedModelConfig, self).__post_init__()
        require(len(self.worker) >= 1, "worker", "argv after `python -m workers`", list(self.worker))
        require(1 <= self.max_batch <= 1024, "max_batch", "1..1024", self.max_batch)
        require(0 <= self.max_wait_ms < math.inf, "max_wait_ms", "milliseconds >= 0", self.max_wait_ms)
        require(
            0 < self.hang_timeout_ms < math.inf, "hang_timeout_ms", "milliseconds > 0", self.hang_timeout_ms
        )
        self.pool()  # checks workers and max_attempts with the pool's own rules
        self.batch_policy()  # checks the policy's name and options with its own rules

    def pool(self) -> PoolConfig:
        """The pool settings of this model's fleet."""
        return PoolConfig(self.workers, self.hang_timeout_ms / 1000, self.max_attempts, model=self.name)

    def batch_policy(self) -> Policy:
        """A fresh flush policy: ``max_batch`` and ``max_wait_ms`` where it takes them, then its options."""
        implied = {"max_batch": self.max_batch, "max_wait": self.max_wait_ms / 1000}
        factory = POLICIES.get(self.policy)
        takes: set[str] = (
            {f.name for f in dataclasses.fields(factory) if f.init}
            if dataclasses.is_dataclass(factory)
            else set()
        )
        params = {name: value for name, value in implied.items() if name in takes}
        return make_policy(self.policy, **params, **self.policy_options)


CONFIG = FixedModelConfig
