"""A fixed-mode model table: its ``run_batch`` workers and the batching in front of them.

``worker`` is either argv after ``python -m workers`` (a built-in kind) or the import path of the
user's own model (``"my_pkg.embed:MiniLM"``, docs/workers.md), which only the worker process
imports; ``pythonpath`` (relative to the configuration file) and ``worker_options`` go with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from batcher.core.config import ModelConfig, Outputs, PoolConfig, require
from batcher.fixed.policy import POLICIES, Policy, make_policy

_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FixedModelConfig(ModelConfig):
    """A fixed-mode model: ``run_batch`` workers and the batching in front of them."""

    mode: str = "fixed"
    worker: str | tuple[str, ...]  # "module:Name" (the worker API), or argv of a built-in kind
    pythonpath: tuple[str, ...] = ()  # directories put first on the workers' import path
    worker_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # its keyword arguments
    kind: str = "text"  # what it answers each input with: "text", or "embedding" (a vector)
    dimensions: int = 0  # an embedding's length (its vectors are checked against it)
    shortenable: bool = False  # an embedding a request may shorten (Matryoshka): /v1/embeddings' dimensions
    workers: int = 8
    max_batch: int = 50
    max_wait_ms: float = 150.0
    hang_timeout_ms: float = 1000.0
    max_attempts: int = 3
    dispatch_ahead_ms: float = 0.0  # a busy worker this near the end of its call is sent its next batch
    policy: str = "size_or_timeout"  # a name in batcher.fixed.policy.POLICIES
    policy_options: dict[str, float] = dataclasses.field(default_factory=dict)  # its own parameters

    def __post_init__(self) -> None:
        super(FixedModelConfig, self).__post_init__()
        if isinstance(self.worker, str):
            require(bool(_TARGET.fullmatch(self.worker)), "worker",
                    "an import path 'module:Name' (or argv after `python -m workers`)", self.worker)
            require(_plain(self.worker_options), "worker_options",
                    "a table of strings, numbers, booleans, lists and tables", self.worker_options)
        else:
            require(len(self.worker) >= 1, "worker", "argv after `python -m workers`", list(self.worker))
            require(not self.pythonpath and not self.worker_options, "worker",
                    "an import path 'module:Name' where pythonpath or worker_options are given",
                    list(self.worker))
        require(all(self.pythonpath), "pythonpath", "directories", list(self.pythonpath))
        Outputs(self.kind, self.dimensions, self.shortenable)  # checks them with their own rules
        require(1 <= self.max_batch <= 1024, "max_batch", "1..1024", self.max_batch)
        require(0 <= self.max_wait_ms < math.inf, "max_wait_ms", "milliseconds >= 0", self.max_wait_ms)
        require(
            0 < self.hang_timeout_ms < math.inf, "hang_timeout_ms", "milliseconds > 0", self.hang_timeout_ms
        )
        require(0 <= self.dispatch_ahead_ms < math.inf, "dispatch_ahead_ms", "milliseconds >= 0",
                self.dispatch_ahead_ms)
        self.pool_config()  # checks workers, max_attempts and the scaler's keys with the pool's own rules
        self.batch_policy()  # checks the policy's name and options with its own rules

    @property
    def outputs(self) -> Outputs:
        return Outputs(self.kind, self.dimensions, self.shortenable)

    @property
    def argv(self) -> list[str]:
        """Its workers' command line after ``python -m workers``."""
        if not isinstance(self.worker, str):
            return list(self.worker)
        paths = [arg for path in self.pythonpath for arg in ("--pythonpath", path)]
        return ["model", self.worker, *paths, "--options", json.dumps(self.worker_options)]

    def located(self, base: str) -> FixedModelConfig:
        """This table with ``pythonpath`` relative to ``base`` (the configuration file's
        directory), each checked to be a directory."""
        paths = tuple(os.path.abspath(os.path.join(base, os.path.expanduser(p))) for p in self.pythonpath)
        for path in paths:
            require(os.path.isdir(path), "pythonpath", "directories", path)
        return dataclasses.replace(self, pythonpath=paths)

    def pool_config(self) -> PoolConfig:
        """The pool settings of this model's fleet: a slot for every worker it may hold, and
        ``min_workers`` started when it opens if it scales."""
        PoolConfig(self.workers)  # `workers` by the pool's own rules, whatever the scaler's keys say
        scaling = self.scaling(self.workers)
        ahead = self.dispatch_ahead_ms / 1000
        if not scaling.elastic:
            return PoolConfig(self.workers, self.hang_timeout_ms / 1000, self.max_attempts, model=self.name,
                              dispatch_ahead=ahead)
        return PoolConfig(scaling.slots, self.hang_timeout_ms / 1000, self.max_attempts, model=self.name,
                          dispatch_ahead=ahead, initial=scaling.min_workers)

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


def _plain(value: object) -> bool:
    """Whether ``value`` crosses to a worker as JSON unchanged (TOML dates and times do not)."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str | int | bool)


CONFIG = FixedModelConfig
