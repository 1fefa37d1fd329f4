"""A worker slot of the fixed-mode pool: the worker interface it runs, its states, and what the
pool keeps and reports of it (:class:`~batcher.fixed.pool.WorkerPool` is the logic over them)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Protocol

import trio

from batcher.core.supervisor import Process, Supervisor
from batcher.fixed.request import Batch
from workers.protocol import Error, Result, RunBatch, Skip


class Worker(Process, Protocol):
    """One fixed-mode worker process (or its simulation), from the pool's side of the pipe."""

    async def send(self, frame: RunBatch | Skip) -> None:
        """Send a call (it starts once the call before it, if any, has ended), or the positions
        of a call not yet started to leave out; NotDelivered if the worker is gone."""

    async def reply(self, call: int) -> tuple[list[int], Result | Error]:
        """Wait for call ``call`` to start and end: the positions it left out, and its answer
        (one output per input run); raise WorkerLost (NotDelivered if the worker was gone
        before the call reached it) or ProtocolError."""


Spawn = Callable[[int], Worker]
"""Makes a fresh, unstarted worker for a slot index (which picks its GPU)."""


class SlotState(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    HUNG = "hung"  # reported only (WorkerInfo): busy past the time a call may run before it is hung
    WARM = "warm"  # ready, and kept from traffic until a scaler promotes it
    DRAINING = "draining"  # reported only: leaving once its call ends
    STOPPED = "stopped"  # no worker: a slot a scaler may staff


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A snapshot of one slot, for tests, health checks and metrics."""

    slot: int
    pid: int | None
    state: SlotState
    restarts: int
    placement: str = "local"


class Slot:
    """One GPU's worker slot as the pool keeps it: its state, its supervisor, its current call
    and the channel that hands it batches."""

    __slots__ = (
        "ahead",
        "busy_since",
        "call",
        "call_ends",
        "idle_scope",
        "inbox",
        "index",
        "outbox",
        "sends",
        "state",
        "supervisor",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = SlotState.STARTING
        self.supervisor: Supervisor[Worker]
        self.busy_since = 0.0  # when its current call was sent
        self.call: Batch | None = None  # the batch its worker is running...
        self.call_ends = 0.0  # ...until its hang timeout
        self.idle_scope = trio.CancelScope()  # cancelled when the worker dies while idle
        self.outbox, self.inbox = trio.open_memory_channel[Batch](1)
        self.ahead: Batch | None = None  # sent while its call ran, to start when that call ends
        self.sends: trio.MemorySendChannel[RunBatch | Skip] | None = None  # its worker's frames, in order


SERVING = (SlotState.IDLE, SlotState.BUSY)
"""The reported states of a worker that can take work now or soon."""
