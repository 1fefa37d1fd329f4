"""The one path by which a model version opens, at start-up and at a live reload alike: its mode
prepared, its workers placed (:func:`spawn`), its backend opened over them, on the trio thread."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from batcher.core.backend import Backend
from batcher.core.config import ModelConfig, QueueConfig
from batcher.core.modes import mode_of
from batcher.placement.spawn import placed


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
