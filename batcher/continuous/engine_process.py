"""The pool's side of one engine worker process (``python -m workers engine ...``): frames in
batches, one engine step at a time.

The worker writes a step's frames (a ``tokens`` frame per sequence that made a token, the
``finished`` ones, then ``stats`` when due) in one write, and :meth:`EngineProcess.receive` reads
until the bytes end on a frame boundary, so a step is never handled in two halves: its tokens
reach the pool's callbacks in one pass and cross to the HTTP side in one hop, and a ``finished``
frame comes with its sequence's last ``tokens`` frame (so the pool knows an end-of-sequence id
is not text). Start-up waits for ``ready`` and then the first ``stats`` frame, so the pool knows
each replica's KV cache size before it routes anything there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Protocol

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.supervisor import Process
from batcher.placement.local import PipeProcess, interpreter_env
from workers.protocol import EngineStats, Message, ProtocolError, WorkerLost


class EngineWorker(Process, Protocol):
    """An engine worker as the pool drives it: an :class:`EngineProcess`, or the simulated
    engine (:mod:`batcher.sim.continuous.engine`)."""

    first_stats: EngineStats  # the engine's stats as it started: its KV cache size

    async def send(self, data: bytes) -> None:
        """Write encoded frames; raises WorkerLost once the worker is gone."""

    async def receive(self) -> list[Message]:
        """The frames of the worker's next write (a step's), whole."""


class EngineProcess(PipeProcess):
    """An engine worker: start, then :meth:`send` frames and :meth:`receive` batches of them."""

    first_stats: EngineStats

    async def start(self) -> None:
        await super().start()
        stats = await self._receive()
        if not isinstance(stats, EngineStats):
            raise ProtocolError(f"expected stats after ready, got {stats.kind}")
        self.first_stats = stats

    async def send(self, data: bytes) -> None:
        """Write encoded frames; raises WorkerLost once the worker's pipe is closed."""
        assert self._to_worker is not None, "send before start"
        try:
            await self._to_worker.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerLost(f"pid {self.pid}: pipe closed ({exc})") from None

    async def receive(self) -> list[Message]:
        """The frames of the next read, continued until they end on a frame boundary."""
        messages = list(self._received)
        self._received.clear()
        while not messages or self._decoder.pending:
            messages += self._decoder.feed(await self._read())
        return messages


async def convert_once(model: ContinuousModelConfig) -> None:
    """Convert a :data:`~batcher.core.config.CONVERTED` model the first time it is served, in a child
    process whose progress goes to this process's output (experiments/docs/start-up.md;
    a later start finds the conversion done and returns at once). The continuous
    mode's preparation, at start-up and at a reload alike; ``ValueError`` if it fails."""
    argv = model.conversion_argv()
    if argv is None:
        return
    result = await trio.run_process([sys.executable, "-m", *argv], check=False)
    if result.returncode != 0:
        raise ValueError(f"model: converting {model.model!r} failed (exit {result.returncode}); "
                         "see the gateway's output")


ENGINE_MODULES = {"ferry": "torch", "vllm": "vllm"}
"""The module an engine's interpreter must be able to import, besides ferry's ``workers``."""


async def check_interpreter(model: ContinuousModelConfig) -> None:
    """Refuse to start a model whose interpreter cannot run its engine workers (no vLLM in it,
    or no ``workers`` on its path), with one line naming the model, rather than an engine that
    dies at every restart. Only where it is not the gateway's own interpreter running ferry's
    engine (that one imports ``workers`` already). ``ValueError`` naming the field if it cannot."""
    needed = ENGINE_MODULES[model.engine]
    if model.simulated or (model.interpreter == sys.executable and model.engine == "ferry"):
        return
    probe = f"import importlib.util as u, sys, workers.protocol; sys.exit(u.find_spec({needed!r}) is None)"
    env = {**os.environ, **interpreter_env(model.interpreter)}
    result = await trio.run_process([model.interpreter, "-c", probe], check=False, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if result.returncode != 0:
        raise ValueError(
            f"python: {model.interpreter} cannot run the {model.engine} engine of {model.name!r} "
            f"(it needs ferry's workers package and {needed}; `make vllm-env` builds one for vllm)")


async def prepare_engines(model: ContinuousModelConfig) -> None:
    """The continuous mode's preparation, at start-up and at a reload alike: the model converted
    if it must be (before its tokenizer is read: the conversion writes it), then its workers'
    interpreter checked."""
    await convert_once(model)
    await check_interpreter(model)
