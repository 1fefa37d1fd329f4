"""The registry of serving modes: a model table's ``mode`` names its entry here.

Each entry is its mode's :class:`~batcher.core.mode.Mode`, built in the mode's own module. The
config loader takes a model table's fields from ``MODES[mode].config``; the running core opens
every version through :func:`launch` (start-up and a reload alike, the preparation first, on
the trio thread); ``/metrics`` asks each mode for its own families. A new mode is a module that
builds a ``Mode`` and one line below.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from batcher.continuous import pool as continuous
from batcher.core.backend import Backend
from batcher.core.config import ModelConfig, QueueConfig
from batcher.core.mode import Mode
from batcher.fixed import mode as fixed_mode
from batcher.placement.spawn import placed

MODES: dict[str, Mode] = {
    "fixed": fixed_mode.MODE,
    "continuous": continuous.MODE,
}
"""Each mode by the name a model table's ``mode`` gives; ``mode`` defaults to ``fixed``."""


def mode_of(model: ModelConfig) -> Mode:
    """The registered mode of a model; ``ValueError`` for a mode no entry serves."""
    mode = MODES.get(model.mode)
    if mode is None:
        raise ValueError(f"model {model.name!r}: mode {model.mode!r} is not one of {sorted(MODES)}")
    return mode


async def prepare(model: ModelConfig) -> None:
    """Make what a model's workers and tokenizer will read (a continuous model converted from
    its source the first time it is served); quick once it is done, so preparing twice is
    harmless. Start-up and a reload both prepare through here, on the trio thread."""
    await mode_of(model).prepare(model)


def spawn(model: ModelConfig) -> Callable[[int], Any]:
    """The factory of a model's worker processes, one per slot: ``python -m workers`` with the
    mode's argv, each on its own device. Every backend's workers are made here, so where and
    how a worker runs is decided in this one place."""
    mode = mode_of(model)
    return placed(model, mode.argv(model), mode.process)


@contextlib.asynccontextmanager
async def launch(
    model: ModelConfig, queue: QueueConfig, tokenizers: Callable[[str], Any]
) -> AsyncIterator[Backend]:
    """A model version's backend over its worker processes, prepared first: open (every worker
    ready) while entered, its workers stopped when left. ``tokenizers`` reads a tokenizer by
    its config name (the gateway's registry: the core never reads one itself)."""
    mode = mode_of(model)
    await mode.prepare(model)  # before the tokenizer is read: a conversion writes it
    async with mode.open(model, queue, spawn(model), tokenizers(model.tokenizer)) as backend:
        yield backend
