"""Where a model's workers run: the one choice between local child processes and Ray actors.

Both placements give the pools the same worker (``start``, frames, ``wait_exit``, ``stop``,
``pid`` and ``placement`` for ``/readyz``); a model table's ``placement`` picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from batcher.core.config import ModelConfig
from batcher.placement.local import PipeProcess, process_workers
from batcher.placement.ray_actors import ray_workers

P = TypeVar("P", bound=PipeProcess)


def placed(model: ModelConfig, argv: Sequence[str], kind: type[P]) -> Callable[[int], P]:
    """A spawn of ``model``'s workers of ``kind`` running ``python -m workers *argv`` where the
    model says: its own processes here (``local``), or Ray actors on a cluster (``ray``)."""
    if model.placement == "ray":
        return ray_workers(model, argv, kind)
    workers = model.workers  # type: ignore[attr-defined]  # every mode's table has it; ModelConfig does not
    return process_workers(argv, workers, kind=kind, python=model.interpreter)
