"""The hand-off between the gateway's asyncio thread and the trio core: the only module that
knows both loops (DESIGN §1).

The trio core (batchers, pools, supervision) runs in one ``trio.run`` on its own thread. The
asyncio side calls :meth:`Bridge.submit` and awaits the returned :class:`Handle`'s future; a
handler that goes away calls :meth:`Bridge.cancel`. A thread hop costs tens of microseconds
(~24 µs with uvloop), so hops are batched in both directions::

    asyncio thread                                          trio thread
    submit/cancel ──> outgoing list ──one call_soon per loop iteration──┐
                                                                        │ run_sync_soon(ops)
                                                 batcher.enqueue / cancel <┘
    future.set_result <── one call_soon_threadsafe per trio wake-up <── finished list <── on_done

so a burst of 50 submits crosses in one hop, and a finished batch of 50 comes back in one.
A finished :class:`~batcher.types.Request` is handed over whole: it is terminal, so the trio
side never touches it again and the asyncio side may read it freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from batcher.config import FerryConfig
from batcher.fixed import Batcher, open_batcher
from batcher.process_worker import process_workers
from batcher.types import Request
from gateway.api import Unavailable

log = logging.getLogger("ferry.bridge")

OpenCore = Callable[[], AbstractAsyncContextManager[Mapping[str, Batcher]]]
"""Opens the trio core (in the trio thread) and yields a batcher per model name."""


class CoreStopped(Unavailable):
    """The trio core is not running (not started, stopped, or crashed): the request cannot run."""


class Handle:
    """The asyncio side's view of one submitted request: await ``future`` for the finished
    :class:`~batcher.types.Request` (state DONE, FAILED or CANCELLED)."""

    __slots__ = ("model", "input", "tier", "timeout", "future", "request", "left")

    def __init__(self, model: str, input: str, tier: str | None, timeout: float | None, future: asyncio.Future) -> None:
        self.model = model
        self.input = input
        self.tier = tier
        self.timeout = timeout
        self.future: asyncio.Future[Request] = future
        self.request: Request | None = None  # set and used on the trio thread only
        self.left = False  # the caller went away and the core was told


@contextlib.asynccontextmanager
async def open_batchers(config: FerryConfig) -> AsyncIterator[dict[str, Batcher]]:
    """The production core: one batcher and one pool of worker processes per model."""
    queue = config.queue()
    async with contextlib.AsyncExitStack() as stack:
        batchers = {}
        for model in config.models:
            spawn = process_workers(model.worker, model.workers)
            batchers[model.name] = await stack.enter_async_context(
                open_batcher(spawn, model.pool(), model.batch_policy(), queue)
            )
        yield batchers


class Bridge:
    """Runs the trio core on its own thread and carries requests and results across."""

    def __init__(self, open_core: OpenCore) -> None:
        self._open_core = open_core
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._batchers: Mapping[str, Batcher] = {}
        self._ready: asyncio.Future[None] | None = None
        self.ended: asyncio.Future[BaseException | None] | None = None
        """Resolves (to the core's exception, or None) when the trio thread has finished."""
        # asyncio side
        self._outgoing: list[tuple[bool, Handle]] = []  # (is_submit, handle)
        self._refusal: BaseException | None = None  # set by refuse_all: what every submit fails with
        self._flush_pending = False
        self._inflight: set[Handle] = set()
        # trio side
        self._finished: list[tuple[Handle, Request]] = []
        self._finished_event: trio.Event | None = None
        # hop counters: requests per hop is the batching the design promises
        self.hops_to_trio = 0
        self.hops_to_asyncio = 0

    # --- asyncio side ------------------------------------------------------------------

    async def start(self) -> None:
        """Start the trio thread and return once the core (every model's workers) is up."""
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
        return self.ended is not None and self._ready is not None and self._ready.done() and not self.ended.done()

    def submit(self, model: str, input: str, tier: str | None = None, timeout: float | None = None) -> Handle:
        """Hand one request to the core; await ``handle.future`` for its finished Request."""
        if self._refusal is not None:
            raise self._refusal
        if not self.running:
            raise CoreStopped("the scheduling core is not running")
        assert self._loop is not None
        handle = Handle(model, input, tier, timeout, self._loop.create_future())
        self._inflight.add(handle)
        self._send(True, handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """The caller went away: take the request out of its queue, or drop its output."""
        future = handle.future
        if handle.left or (future.done() and not future.cancelled()):
            return  # cancelled already, or finished: nothing left to take back
        # The future may be cancelled already: a cancelled task cancels the future it awaits.
        handle.left = True
        future.cancel()
        self._inflight.discard(handle)
        if self.running:
            self._send(False, handle)

    def refuse_all(self, error: BaseException) -> None:
        """Fail every request in flight with ``error`` now, and every later submit: the server
        is stopping and will not wait for them (their handlers answer with the error)."""
        self._refusal = error
        self._fail_all(error)

    def batcher(self, model: str) -> Batcher:
        """A model's batcher, for read-only snapshots (health, stats) from the asyncio thread.

        Reading plain attributes across threads is safe under the GIL; a snapshot may be a
        few microseconds stale, which a health check does not mind.
        """
        return self._batchers[model]

    def _send(self, is_submit: bool, handle: Handle) -> None:
        self._outgoing.append((is_submit, handle))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)  # type: ignore[union-attr]

    def _flush(self) -> None:
        ops, self._outgoing = self._outgoing, []
        self._flush_pending = False
        try:
            self._token.run_sync_soon(self._on_trio, ops)  # type: ignore[union-attr]
            self.hops_to_trio += 1
        except trio.RunFinishedError:
            self._fail_all(CoreStopped("the scheduling core has stopped"))

    def _deliver(self, finished: list[tuple[Handle, Request]]) -> None:
        inflight = self._inflight
        for handle, request in finished:
            inflight.discard(handle)
            if not handle.future.done():
                handle.future.set_result(request)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._inflight):
            self._reject(handle, error)

    def _reject(self, handle: Handle, error: BaseException) -> None:
        self._inflight.discard(handle)
        if not handle.future.done():
            handle.future.set_exception(error)

    def _core_ready(self) -> None:
        if not self._ready.done():  # type: ignore[union-attr]
            self._ready.set_result(None)  # type: ignore[union-attr]

    def _core_ended(self, error: BaseException | None) -> None:
        self._fail_all(CoreStopped("the scheduling core has stopped"))
        if not self._ready.done():  # type: ignore[union-attr]
            self._ready.set_exception(error or CoreStopped("the scheduling core stopped while starting"))  # type: ignore[union-attr]
        if not self.ended.done():  # type: ignore[union-attr]
            self.ended.set_result(error)  # type: ignore[union-attr]

    # --- trio side ---------------------------------------------------------------------

    def _run_trio(self) -> None:
        error: BaseException | None = None
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - handed to the asyncio side, which decides
            log.exception("the trio core failed")
            error = exc
        self._call_asyncio(self._core_ended, error)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._finished_event = trio.Event()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            async with self._open_core() as batchers:
                self._batchers = batchers
                nursery.start_soon(self._return_finished)
                self._call_asyncio(self._core_ready)
                await trio.sleep_forever()

    def _cancel_core(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def _on_trio(self, ops: list[tuple[bool, Handle]]) -> None:
        """Run a batch of submits and cancels, in the order the asyncio side made them."""
        for is_submit, handle in ops:
            if is_submit:
                try:
                    batcher = self._batchers[handle.model]
                    request = batcher.request(handle.input, handle.tier, handle.timeout,
                                              on_done=functools.partial(self._request_done, handle))
                except (KeyError, ValueError) as exc:  # a model or tier the core does not know
                    self._call_asyncio(self._reject, handle, CoreStopped(f"cannot queue the request: {exc}"))
                    continue
                handle.request = request
                batcher.enqueue(request)
            elif handle.request is not None:
                self._batchers[handle.model].cancel(handle.request)

    def _request_done(self, handle: Handle, request: Request) -> None:
        self._finished.append((handle, request))
        self._finished_event.set()  # type: ignore[union-attr]

    async def _return_finished(self) -> None:
        """Hand everything that finished since the last wake-up to asyncio in one hop."""
        while True:
            await self._finished_event.wait()  # type: ignore[union-attr]
            self._finished_event = trio.Event()
            finished, self._finished = self._finished, []
            self._call_asyncio(self._deliver, finished)
            self.hops_to_asyncio += 1

    def _call_asyncio(self, callback: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(callback, *args)  # type: ignore[union-attr]

