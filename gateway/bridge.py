"""The hand-off between the gateway's asyncio thread and the trio core: the only module that
knows both loops (docs/architecture.md, "The layers").

The asyncio side calls :meth:`Bridge.submit` with a checked :class:`~batcher.core.backend.Job`
and reads the returned :class:`Handle`'s events. A hop that wakes a sleeping loop is costly
(experiments/docs/gateway-http.md), so hops are batched both ways: the submits of one asyncio
loop iteration cross in one ``run_sync_soon``, the events of one trio wake-up come back in one
``call_soon_threadsafe`` as ``(handle, events)`` pairs. :meth:`Bridge.open`, :meth:`Bridge.close`
and :meth:`Bridge.retune` change the fleet in the same ordered hops, so a submit made before a
close reaches its backend first. Nothing on the asyncio side touches an object the trio side
owns: events are frozen values, and ``/readyz`` and ``/metrics`` read immutable snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from batcher.core.backend import TERMINAL_EVENTS, Event, Failed, Job, Snapshot
from batcher.core.config import ModelConfig, QueueConfig
from batcher.core.counters import Counters
from batcher.core.fleet import Fleet, Launch
from batcher.placement import launch
from gateway.text.tokenizer import make_tokenizer
from gateway.wire.api import Unavailable

log = logging.getLogger("ferry.bridge")


class CoreStopped(Unavailable):
    """The trio core is not running (not started, stopped, or crashed): the request cannot run."""


class Handle:
    """One submitted job. The asyncio side awaits :meth:`wait` for its events, in order; the
    last one is a ``Finished`` or a ``Failed``."""

    __slots__ = ("_waiter", "ended", "events", "job", "left", "model", "outbox", "ticket")

    def __init__(self, model: str, job: Job) -> None:
        self.model = model
        self.job = job
        # asyncio side
        self.events: list[Event] = []  # arrived, not yet taken by wait()
        self.ended = False  # a terminal event has arrived
        self.left = False  # the caller went away and the core was told
        self._waiter: asyncio.Future[None] | None = None
        # trio side
        self.outbox: list[Event] = []  # emitted, not yet handed over
        self.ticket: object = None  # the backend's, for cancel

    async def wait(self, timeout: float | None = None) -> list[Event]:
        """Every event that has arrived since the last call; waits up to ``timeout`` seconds for
        one (an empty list: the wait timed out, or the job has ended and everything was taken)."""
        if not self.events and not self.ended:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await waiter
                else:
                    await asyncio.wait((waiter,), timeout=timeout)
            finally:
                self._waiter = None
                waiter.cancel()
        events, self.events = self.events, []
        return events

    def _arrive(self, events: list[Event]) -> None:
        self.events.extend(events)
        if isinstance(events[-1], TERMINAL_EVENTS):
            self.ended = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Bridge:
    """Runs the trio core on its own thread and carries jobs, events and snapshots across."""

    def __init__(self, launch: Launch, models: Sequence[ModelConfig], queue: QueueConfig) -> None:
        self._launch = launch
        self._models = tuple(models)  # opened at start
        self._queue = queue
        self._loop: asyncio.AbstractEventLoop  # the gateway's, from start() on
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery  # the core's, and its fleet, from _main on (before any op arrives)
        self._fleet: Fleet
        self._ready: asyncio.Future[None] | None = None
        self.ended: asyncio.Future[BaseException | None] | None = None
        """Resolves (to the core's exception, or None) when the trio thread has finished."""
        # asyncio side
        self._outgoing: list[tuple[str, Any]] = []  # (op, handle or future)
        self._refusal: Exception | None = None  # set by refuse_all: what every submit fails with
        self._flush_pending = False
        self._inflight: set[Handle] = set()
        # trio side
        self._dirty: list[Handle] = []  # handles with events in their outbox
        self._events_ready: trio.Event  # from _main on
        # hop counters: requests per hop is the batching the design promises
        self.hops_to_trio = 0
        self.hops_to_asyncio = 0

    # --- asyncio side ------------------------------------------------------------------

    async def start(self) -> None:
        """Start the trio thread and return once the core is up: every model opened at start
        (all its workers ready), or raise what kept one from opening."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.ended = self._loop.create_future()
        self._thread = threading.Thread(target=self._run_trio, name="ferry-trio", daemon=True)
        self._thread.start()
        await asyncio.shield(self._ready)

    async def stop(self) -> None:
        """Cancel the trio core (its workers are stopped) and wait for its thread to end."""
        if self._thread is None or self.ended is None:
            return
        if not self.ended.done() and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._cancel_core)
        await asyncio.shield(self.ended)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def running(self) -> bool:
        return (
            self.ended is not None
            and self._ready is not None
            and self._ready.done()
            and not self.ended.done()
        )

    def submit(self, model: str, job: Job) -> Handle:
        """Hand one job to a model's backend; read its events with ``await handle.wait()``."""
        if self._refusal is not None:
            raise self._refusal
        if not self.running:
            raise CoreStopped("the scheduling core is not running")
        handle = Handle(model, job)
        self._inflight.add(handle)
        self._send("submit", handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """The caller went away: take the job out of its queue, or drop its output."""
        if handle.left or handle.ended:
            return  # cancelled already, or finished: nothing left to take back
        handle.left = True
        self._inflight.discard(handle)
        if self.running:
            self._send("cancel", handle)

    def refuse_all(self, error: Exception) -> None:
        """Fail every job in flight with ``error`` now, and every later submit: the server is
        stopping and will not wait for them (their handlers answer with the error)."""
        self._refusal = error
        self._fail_all(error)

    async def snapshots(self) -> dict[str, Snapshot[Counters]]:
        """Every open backend's state, copied on the trio thread: what /readyz and /metrics show."""
        snapshots: dict[str, Snapshot[Counters]] = await self._ask("snapshot")
        return snapshots

    async def open(self, model: ModelConfig) -> None:
        """Open a model version's backend in the running core; returns once it takes jobs
        (every worker ready), or raises what kept it from opening. The rest runs on meanwhile."""
        await self._ask("open", model)

    async def prepare(self, model: ModelConfig) -> None:
        """Prepare a model version in the core as its start would (a continuous model converted
        once), so the gateway can read its tokenizer before it opens; the rest runs on meanwhile."""
        await self._ask("prepare", model)

    async def close(self, name: str) -> None:
        """Stop a version's backend and its workers; returns once they are gone. Its jobs still
        in flight (none, once it has drained) end with a retryable failure."""
        await self._ask("close", name)
        stopped = CoreStopped(f"model {name} was stopped before the request finished")
        for handle in [handle for handle in self._inflight if handle.model == name]:
            self._deliver([(handle, [Failed(stopped, retryable=True)])])

    async def retune(self, queue: QueueConfig) -> None:
        """The tiers' new wait budgets, for every open backend and every one opened later."""
        await self._ask("retune", queue)

    async def _ask(self, op: str, *args: Any) -> Any:
        """An operation on the trio side, in order with submits and cancels; its result."""
        if not self.running:
            raise CoreStopped("the scheduling core is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._send(op, (future, *args))
        return await future

    def _send(self, op: str, subject: Any) -> None:
        self._outgoing.append((op, subject))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        ops, self._outgoing = self._outgoing, []
        self._flush_pending = False
        assert self._token is not None, "ops are sent once the core runs"
        try:
            self._token.run_sync_soon(self._on_trio, ops)
            self.hops_to_trio += 1
        except trio.RunFinishedError:
            self._fail_all(CoreStopped("the scheduling core has stopped"))
            for op, subject in ops:
                if op not in ("submit", "cancel") and not subject[0].done():
                    subject[0].set_exception(CoreStopped("the scheduling core has stopped"))

    def _deliver(self, batch: list[tuple[Handle, list[Event]]]) -> None:
        inflight = self._inflight
        for handle, events in batch:
            if handle.left:
                continue
            handle._arrive(events)
            if handle.ended:
                inflight.discard(handle)

    def _fail_all(self, error: Exception) -> None:
        for handle in list(self._inflight):
            self._deliver([(handle, [Failed(error, retryable=True)])])

    def _core_ready(self) -> None:
        assert self._ready is not None, "the core starts after start()"
        if not self._ready.done():
            self._ready.set_result(None)

    def _core_ended(self, error: BaseException | None) -> None:
        self._fail_all(CoreStopped("the scheduling core has stopped"))
        assert self._ready is not None and self.ended is not None, "the core ends after start()"
        if not self._ready.done():
            stopped = error or CoreStopped("the scheduling core stopped while starting")
            self._ready.set_exception(stopped)
        if not self.ended.done():
            self.ended.set_result(error)

    # --- trio side ---------------------------------------------------------------------

    def _run_trio(self) -> None:
        error: BaseException | None = None
        try:
            trio.run(self._main)
        except BaseException as exc:
            log.exception("the trio core failed")
            error = exc
        self._call_asyncio(self._core_ended, error)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._events_ready = trio.Event()
        async with trio.open_nursery() as nursery:
            self._scope, self._nursery = nursery.cancel_scope, nursery
            fleet = self._fleet = Fleet(nursery, self._launch, self._queue)
            async with trio.open_nursery() as opening:  # every model at once; one failure fails the start
                for model in self._models:
                    opening.start_soon(fleet.open, model)
            nursery.start_soon(self._return_events)
            self._call_asyncio(self._core_ready)

    def _cancel_core(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def _on_trio(self, ops: list[tuple[str, Any]]) -> None:
        """Run a batch of operations in the order the asyncio side made them; those that take
        time (opening and closing a version) run as tasks of the core's nursery."""
        fleet = self._fleet
        for op, subject in ops:
            if op == "submit":
                self._start(subject)
            elif op == "cancel":
                if subject.ticket is not None and subject.model in fleet:
                    fleet[subject.model].cancel(subject.ticket)
                subject.ticket = None
            elif op == "snapshot":
                backends = fleet.items()
                snapshots = {name: backend.snapshot() for name, backend in backends}
                self._call_asyncio(_settle, subject[0], (snapshots, None))
            elif op == "retune":
                future, queue = subject
                self._call_asyncio(_settle, future, _outcome(fleet.retune, queue))
            else:
                self._nursery.start_soon(self._change, op, *subject)

    async def _change(self, op: str, future: asyncio.Future[None], subject: Any) -> None:
        """Prepare, open or close a version; the asyncio side hears how it went (after the events
        its backend emitted before closing, so a finished job is never mistaken for a stopped one)."""
        fleet = self._fleet
        changes: dict[str, Callable[[Any], Awaitable[None]]] = {
            "prepare": launch.prepare, "open": fleet.open, "close": fleet.close  # of a model, a model, a name
        }
        change = changes[op]
        try:
            await change(subject)
        except Exception as exc:  # noqa: BLE001 - the caller (a reload) reports it; the core runs on
            outcome: tuple[Any, BaseException | None] = (None, exc)
        else:
            outcome = (None, None)
        self._hand_over()
        self._call_asyncio(_settle, future, outcome)

    def _start(self, handle: Handle) -> None:
        on_event = functools.partial(self._on_event, handle)
        try:
            backend = self._fleet[handle.model]
            ticket = backend.submit(handle.job, on_event)
            if not (handle.outbox and isinstance(handle.outbox[-1], TERMINAL_EVENTS)):  # not shed at once
                handle.ticket = ticket
        except (KeyError, ValueError) as exc:  # a model or tier the core does not know
            on_event(Failed(CoreStopped(f"cannot queue the request: {exc}"), retryable=False))

    def _on_event(self, handle: Handle, event: Event) -> None:
        if not handle.outbox:
            self._dirty.append(handle)
        handle.outbox.append(event)
        if isinstance(event, TERMINAL_EVENTS):
            # The ticket (the backend's request) holds this callback, which holds the handle: a
            # cycle per request, left for the cyclic collector, which then cost the gateway ~5 %
            # of a core at 1,600 requests/s. A finished job needs no ticket.
            handle.ticket = None
        self._events_ready.set()

    async def _return_events(self) -> None:
        """Hand every event emitted since the last wake-up to asyncio in one hop."""
        while True:
            await self._events_ready.wait()
            self._events_ready = trio.Event()
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, []
        batch = []
        for handle in dirty:
            batch.append((handle, handle.outbox))
            handle.outbox = []
        self._call_asyncio(self._deliver, batch)
        self.hops_to_asyncio += 1

    def _call_asyncio(self, callback: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(callback, *args)


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    try:
        return call(*args), None
    except Exception as exc:  # noqa: BLE001 - handed to the asyncio side, which reports it
        return None, exc


def _settle(future: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    value, error = outcome
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


open_backend: Launch = functools.partial(launch.launch, tokenizers=make_tokenizer)
"""The production :data:`~batcher.core.fleet.Launch`: a model version's backend, prepared and opened
by its mode's registry entry (:func:`batcher.placement.launch.launch`), with the gateway's tokenizers."""
