"""Supervision of one worker slot: spawn, wait for ready, serve, notice death, restart.

A slot is one GPU; its :class:`Supervisor` keeps one worker process on it while the pool runs.
The owner (either mode's pool) hands in a ``serve`` coroutine, and the supervisor does the rest::

    spawn ──start (start_timeout)──> up: serve(worker) ─┬─ serve returns: the worker must die
                                         exit watch ────┴─ the process exited on its own
      ^                                                          │
      └──── backoff (doubles while workers serve nothing) <── kill, reap

The exit watch notices a worker that dies idle when it dies (``on_exit``); :class:`Readiness`
is the fleet's half: a fleet whose workers crash on every call is not ready for traffic."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import trio

from batcher.core.config import PoolConfig
from batcher.core.counters import Counters
from workers.protocol import ModelUnloadable, ProtocolError, WorkerLost

log = logging.getLogger("ferry.pool")

SHUTDOWN_GRACE = 2.0
"""Seconds an idle worker of a fleet that is stopping gets, after the end of its input, to close
its model and exit before it is killed; one in a call, or one that failed, is killed at once."""


class Process(Protocol):
    """What supervision needs of a worker, real process or simulation, whatever it serves."""

    pid: int | None
    placement: str  # where it runs: "local", or "ray:<address>:<node>" (batcher/placement/ray_actors.py)

    async def start(self) -> None:
        """Spawn and wait for ``ready``; raise WorkerLost or ProtocolError if it never comes."""

    async def wait_exit(self) -> None:
        """Return once the worker has exited (crashed, killed, or stopped)."""

    async def stop(self, grace: float = 0.0) -> None:
        """Kill the worker and reap it; safe to call more than once, or before start. ``grace``:
        first give it that long to exit on its own (its model's ``close()``), as at shutdown."""


class WorkerStartError(Exception):
    """Workers did not come up when their pool started: the configuration is wrong. A pool
    raises one, however many of its workers failed (:func:`start_slots`)."""


class _SlotStartError(Exception):
    """One slot's first worker did not come up (what :func:`start_slots` gathers)."""


def _nothing() -> None:
    pass


def _busy() -> bool:
    return False


def _why(exc: BaseException) -> str:
    """Why a worker did not start: the model's own exception (type and message) when it could
    not be built, else what supervision saw."""
    return f"could not build its model: {exc}" if isinstance(exc, ModelUnloadable) else repr(exc)


W = TypeVar("W", bound=Process)


class Supervisor(Generic[W]):
    """Keeps slot ``index`` staffed with a worker from ``spawn(index)`` (see the module doc).

    ``worker`` is the current worker (or the one starting), ``up`` is True while it is started
    and not yet lost, ``exited`` is True once the exit watch has seen the current worker exit,
    and ``restarts`` counts the workers started after the first (also in ``stats.restarts``).
    """

    def __init__(
        self,
        index: int,
        spawn: Callable[[int], W],
        config: PoolConfig,
        counters: Counters,
        serve: Callable[[W], Awaitable[bool]],
        on_exit: Callable[[], None] = _nothing,
        on_down: Callable[[], None] = _nothing,
        idle: Callable[[], bool] = _busy,
    ) -> None:
        self.index = index
        self.worker: W | None = None
        self.up = False
        self.exited = False
        self.restarts = 0
        self._spawn = spawn
        self._config = config
        self._counters = counters
        self._serve = serve
        self._on_exit = on_exit
        self._on_down = on_down
        self._idle = idle  # at shutdown, an idle worker gets SHUTDOWN_GRACE to close its model

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the first worker (raise if it cannot: :func:`start_slots` reports it), report
        started, then keep the slot staffed until cancelled."""
        backoff = self._config.restart_backoff
        first = True
        while True:
            worker = self.worker = self._spawn(self.index)
            self.exited = False
            try:
                with trio.fail_after(self._config.start_timeout):
                    await worker.start()
            except (WorkerLost, ProtocolError, OSError, trio.TooSlowError) as exc:
                with trio.CancelScope(shield=True):
                    await worker.stop()
                if first:
                    raise _SlotStartError(f"worker {self.index}: {_why(exc)}") from exc
                log.warning("worker %d failed to restart (%r); next try in %.1fs", self.index, exc, backoff)
            except BaseException:  # cancelled while starting (shutdown): leave no process behind
                with trio.CancelScope(shield=True):
                    await worker.stop()
                raise
            else:
                if first:
                    first = False
                    task_status.started()
                if await self._live(worker):
                    backoff = self._config.restart_backoff
            self.restarts += 1
            self._counters.restarts += 1
            await trio.sleep(backoff)
            backoff = min(max(2 * backoff, 0.01), self._config.max_restart_backoff)

    async def _live(self, worker: W) -> bool:
        """Serve with the exit watch beside; kill and reap the worker however it ends."""
        self.up = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, worker)
                served = await self._serve(worker)
                nursery.cancel_scope.cancel()
            return served
        finally:
            self.up = False
            shutting_down = trio.current_effective_deadline() == -math.inf  # cancelled from outside
            closing = shutting_down and self._idle()  # one in a call (hung, say) is killed at once
            self._on_down()
            with trio.CancelScope(shield=True):
                await worker.stop(SHUTDOWN_GRACE if closing else 0.0)

    async def _watch(self, worker: W) -> None:
        await worker.wait_exit()
        self.exited = True
        self._on_exit()


async def start_slots(nursery: trio.Nursery, supervisors: Sequence[Supervisor], model: str) -> None:
    """Start every slot's first worker as a task of ``nursery``; return once all are up.

    If any cannot start, the others are still waited for (each is bounded by its
    ``start_timeout``), so the outcome does not depend on which failure came first: one
    :class:`WorkerStartError` naming the model, how many workers failed, and the reason of the
    lowest slot among them. The workers that did start are stopped when ``nursery`` unwinds."""
    failed: dict[int, _SlotStartError] = {}

    async def start(supervisor: Supervisor) -> None:
        try:
            await nursery.start(supervisor.run)
        except _SlotStartError as exc:
            failed[supervisor.index] = exc

    async with trio.open_nursery() as starting:
        for supervisor in supervisors:
            starting.start_soon(start, supervisor)
    if failed:
        first = failed[min(failed)]
        count = f"{len(failed)} of {len(supervisors)}"
        raise WorkerStartError(f"{model}: {count} workers did not start; first: {first}")


class Readiness:
    """Whether a fleet may be sent traffic (what ``/readyz`` reports), from what its workers did.

    A fleet whose every worker crashes on its first call has workers up between crashes, so
    "a worker is up" would flap between ready and not. Instead: the fleet is not ready once
    every slot has lost its worker since the last answered call, and ready again when a call is
    answered. A fresh fleet is ready (nothing was lost). One worker crashing now and then leaves
    the others' slots untouched, so readiness does not move.
    """

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._lost: set[int] = set()

    @property
    def proven(self) -> bool:
        return len(self._lost) < self._slots

    def lost(self, slot: int) -> None:
        self._lost.add(slot)

    def answered(self) -> None:
        if self._lost:
            self._lost.clear()
