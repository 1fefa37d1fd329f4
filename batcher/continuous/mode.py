"""The continuous mode's registry entry: engine workers behind the :class:`EnginePool`, prepared
by converting a named model once, exporting the ``ferry_engine_*`` families."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.elastic import ContinuousFleet
from batcher.continuous.engine_process import EngineProcess, EngineWorker, prepare_engines
from batcher.continuous.long_prompts import lanes_of, split_spawn
from batcher.continuous.metrics import engine_families
from batcher.continuous.pool import EnginePool, open_engine_pool
from batcher.core.config import QueueConfig
from batcher.core.mode import Mode
from batcher.core.scaling import open_scaled
from batcher.core.tokenizer import Detokenizes
from batcher.placement.spawn import placed


def open_continuous(model: ContinuousModelConfig, queue: QueueConfig, spawn: Callable[[int], EngineWorker],
                    tokenizer: Detokenizes) -> AbstractAsyncContextManager[EnginePool]:
    """The model's engine pool, and its scaler if it has a range of replicas; a long pool's
    replicas run the long table's engines (their own KV cache and step budget)."""
    if model.long_workers:
        lanes = lanes_of(model)
        long = dataclasses.replace(model.long_table(), workers=lanes.ordinary + lanes.long)  # slot = device
        spawn = split_spawn(lanes, spawn, placed(long, long.engine_argv(), EngineProcess))
    opened = open_engine_pool(model, queue, spawn, tokenizer)
    counters = operator.attrgetter("counters")
    return open_scaled(opened, model.scaling(model.workers), ContinuousFleet, counters, model.name)



MODE = Mode(argv=ContinuousModelConfig.engine_argv, process=EngineProcess, open=open_continuous,
            prepare=prepare_engines, families=engine_families)
