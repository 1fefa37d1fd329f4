"""The continuous mode's registry entry: engine workers behind the :class:`EnginePool`, prepared
by converting a named model once, exporting the ``ferry_engine_*`` families."""

from __future__ import annotations

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess, prepare_engines
from batcher.continuous.metrics import engine_families
from batcher.continuous.pool import open_engine_pool
from batcher.core.mode import Mode

MODE = Mode(argv=ContinuousModelConfig.engine_argv, process=EngineProcess, open=open_engine_pool,
            prepare=prepare_engines, families=engine_families)
