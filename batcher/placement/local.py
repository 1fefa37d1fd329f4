"""The pool's side of a real worker process: spawn ``python -m workers ...``, frame I/O over pipes.

Each worker gets its own ``CUDA_VISIBLE_DEVICES``, so a process sees exactly one GPU (or none,
and runs on CPU), and its instance (slot and start number, ``FERRY_WORKER_INSTANCE``), so a
restarted worker with random faults does not replay its predecessor's schedule. Its stderr is
the gateway's, so model logs and stray prints stay visible; the protocol itself only flows
through the pipes (see ``workers/__main__.py`` for how the worker keeps stray prints out of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

import workers as workers_package
from workers.faults import INSTANCE_ENV
from workers.protocol import (
    MAX_FRAME_BYTES,
    FrameDecoder,
    Message,
    ModelUnloadable,
    ProtocolError,
    Ready,
    Unloadable,
    WorkerLost,
)


class PipeProcess:
    """One ``python -m workers`` process and the framed pipe to it: spawn, the ``ready`` frame,
    exit and kill. What flows after ``ready`` is the subclass's (a fixed-mode call at a time
    here; an engine's stream of frames in :mod:`batcher.continuous.engine_process`).

    The frames flow through ``_to_worker`` and ``_from_worker``, which :meth:`_launch` opens;
    a worker placed elsewhere (:mod:`batcher.placement.ray_actors`) opens them on a TCP connection
    instead of pipes and overrides ``_launch``, ``_lost``, ``wait_exit`` and ``stop``, nothing
    else. ``placement`` says where the worker runs, for ``/readyz`` and ``/metrics``.
    """

    placement = "local"

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], max_frame: int = MAX_FRAME_BYTES,
        python: str = sys.executable,
    ) -> None:
        self.argv = [python, "-m", "workers", *argv]
        self.pid: int | None = None
        self.model: str | None = None
        self._env = env
        self._max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self._received: deque[Message] = deque()
        self._process: trio.Process | None = None
        self._to_worker: trio.abc.SendStream | None = None
        self._from_worker: trio.abc.ReceiveStream | None = None

    async def start(self) -> None:
        await self._launch()
        ready = await self._receive()
        if isinstance(ready, Unloadable):
            raise ModelUnloadable(ready.message)
        if not isinstance(ready, Ready):
            raise ProtocolError(f"expected ready as the first frame, got {ready.kind}")
        self.model = ready.model

    async def _launch(self) -> None:
        """Start the process and open the frame streams to it."""
        self._process = await trio.lowlevel.open_process(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env
        )
        self.pid = self._process.pid
        self._to_worker, self._from_worker = self._process.stdin, self._process.stdout

    async def _lost(self) -> str:
        """Why the frames stopped (the log's, never a caller's): called once they have."""
        assert self._process is not None
        return f"pid {self.pid} exited with code {await self._process.wait()}"

    async def wait_exit(self) -> None:
        assert self._process is not None, "wait_exit before start"
        await self._process.wait()

    async def stop(self, grace: float = 0.0) -> None:
        process = self._process
        if process is None:
            return
        if grace and process.returncode is None and process.stdin is not None:
            await process.stdin.aclose()  # its end of input: the worker closes its model and exits
            with trio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
        await process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                await stream.aclose()

    async def _receive(self) -> Message:
        while not self._received:
            self._received.extend(self._decoder.feed(await self._read()))
        return self._received.popleft()

    async def _read(self) -> bytes | bytearray:
        """The worker's next bytes; :class:`WorkerLost` once its stream has ended: at EOF, or
        broken (a worker on another node whose connection is reset as the node goes)."""
        assert self._from_worker is not None, "receive before start"
        try:
            data = await self._from_worker.receive_some(1 << 16)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            raise WorkerLost(await self._lost())
        return data


P = TypeVar("P", bound=PipeProcess)


def worker_devices(workers: int, visible: str | None = None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each worker: round robin over the gateway's own list.

    With no list (no ``CUDA_VISIBLE_DEVICES`` in the environment), worker ``i`` gets device
    ``i``; on a machine with no GPU that is harmless, and the worker runs on CPU.
    """
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    if not devices:
        return [str(index) for index in range(workers)]
    return [devices[index % len(devices)] for index in range(workers)]


def interpreter_env(python: str) -> dict[str, str]:
    """What a worker under ``python`` needs in its environment beyond the gateway's: another
    interpreter (a virtualenv of its own) finds this ``workers`` package on its path."""
    if python == sys.executable:
        return {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(workers_package.__file__)))
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def process_workers(
    argv: Sequence[str], workers: int, kind: type[P], max_frame: int = MAX_FRAME_BYTES,
    python: str = sys.executable,
) -> Callable[[int], P]:
    """A :data:`Spawn` that starts ``python -m workers *argv`` on each slot's own device, and
    names each start (``SLOT:START``, counted from 1 per slot) in its environment; ``kind`` is
    the pool's side of the process (a mode's :class:`PipeProcess`), ``python`` the interpreter it
    runs under."""
    devices = worker_devices(workers)
    starts: Counter[int] = Counter()
    extra = interpreter_env(python)

    def spawn(slot: int) -> P:
        starts[slot] += 1
        env = {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": devices[slot],
               INSTANCE_ENV: f"{slot}:{starts[slot]}"}
        return kind(argv, env, max_frame, python)

    return spawn
