"""What a serving mode is to the core: what the registry (:mod:`batcher.core.modes`) finds in a
mode package's ``mode`` module, its one :class:`Mode`::

    config file [[models]] mode = "m"  ──> m's config.CONFIG (the table's fields, checked)
    start-up, or a reload             ──> Mode.prepare (trio: what its workers will read, once)
                                      ──> Mode.argv + Mode.process: the worker processes' spawn
                                      ──> Mode.open: the Backend over them, while it is entered
    each /metrics scrape              ──> Mode.families (the mode's own families, from snapshots)

Everything a mode does runs on the trio thread; nothing here imports the gateway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from batcher.core.backend import Backend, Snapshot
from batcher.core.config import ModelConfig, QueueConfig
from batcher.core.counters import Counters
from batcher.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

M = TypeVar("M", bound=ModelConfig)  # the mode's model table (its config.CONFIG)
C = TypeVar("C", bound=Counters)  # what its backends count (their snapshots' counters)
C_co = TypeVar("C_co", bound=Counters, covariant=True)


class Exported(NamedTuple, Generic[C_co]):
    """One open backend at a scrape: its version's name, its tiers' names, its snapshot."""

    model: str
    tiers: Sequence[str]
    snapshot: Snapshot[C_co]


async def nothing_to_prepare(model: ModelConfig) -> None:
    """The preparation of a mode whose workers read their model as configured."""


def no_families(backends: Sequence[Exported[Counters]]) -> Iterable[Metric]:
    """The families of a mode that exports only the shared ones."""
    return ()


@dataclasses.dataclass(frozen=True, slots=True)
class Mode(Generic[M, C]):
    """One serving mode (see the module doc), for model tables of type ``M`` whose backends
    count in ``C``.

    ``open(model, queue, spawn, tokenizer)`` is an async context manager: entered, the backend
    takes jobs (its workers are ready); left, its workers have stopped. ``tokenizer`` is the
    model's own, read after ``prepare`` (which may be what writes it). ``families`` turns the
    snapshots of this mode's backends into Prometheus families; the shared ones (queue wait,
    queued work by unit, restarts) are not its business.
    """

    argv: Callable[[M], Sequence[str]]  # a model's worker command: python -m workers ARGV
    process: type  # the pool's side of one worker process
    # open(model, queue, spawn: a fresh unstarted worker for a slot index, tokenizer)
    open: Callable[
        [M, QueueConfig, Callable[[int], Any], Tokenizer], AbstractAsyncContextManager[Backend[Any]]
    ]
    prepare: Callable[[M], Awaitable[None]] = nothing_to_prepare
    families: Callable[[Sequence[Exported[C]]], Iterable[Metric]] = no_families
