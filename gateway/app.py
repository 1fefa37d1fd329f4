"""The aiohttp application: routes, and the path a request takes to the core and back.

    POST /v1/messages  key ─> body ─> checked request ─> model ─> context window ─> admit ─> core
    GET  /v1/models    the served versions        GET /healthz   the process answers
    GET  /readyz       every model has a worker up (JSON detail per model)

Handlers are thin: rules live in :mod:`gateway.api` (pure), identities in :mod:`gateway.auth`,
model names in :mod:`gateway.models`, and the core behind :class:`gateway.bridge.Bridge`.
:meth:`Gateway.admit` is the one place a checked request passes to the core, where per-key
limits (DESIGN §8) will sit. Every error, whoever raises it (aiohttp included), leaves through
:func:`errors_as_json` with the body and status of :data:`gateway.api.ERRORS`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

from aiohttp import web

from batcher.config import FerryConfig
from batcher.pool import SlotState
from batcher.types import Request, State
from gateway import api
from gateway.auth import KeyRing, Principal
from gateway.bridge import Bridge, Handle
from gateway.models import Catalog, ServedModel

log = logging.getLogger("ferry.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Gateway:
    """The state the handlers share: config, keys, models, and the bridge to the core."""

    def __init__(self, config: FerryConfig, bridge: Bridge) -> None:
        self.config = config
        self.bridge = bridge
        self.keys = KeyRing(config.keys)
        self.catalog = Catalog(config.models)
        self.wait_budget = {tier.name: tier.wait_budget_ms / 1000 for tier in config.tiers}
        self.ping_interval = config.server.ping_interval_ms / 1000
        self.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._ids = itertools.count(1)
        self._id_prefix = f"msg_{os.getpid():x}{int(time.time()):x}_"

    def admit(self, principal: Principal, model: ServedModel, prompt: str) -> Handle:
        """Hand a checked request to the core. Admission by per-key limits goes here."""
        return self.bridge.submit(model.name, prompt, principal.tier, self.wait_budget[principal.tier])

    async def messages(self, request: web.Request) -> web.StreamResponse:
        principal = self.keys.authenticate(request.headers)
        call = api.parse_message_request(await request.read())
        model = self.catalog.resolve(call.model)
        prompt = api.render_prompt(call)
        input_tokens = model.tokenizer.count(prompt)
        if error := api.context_overflow(input_tokens, call.max_tokens, model.config.context_window):
            raise error
        handle = self.admit(principal, model, prompt)
        message_id = f"{self._id_prefix}{next(self._ids)}"
        if call.stream:
            return await self._stream(request, handle, call, model, message_id, input_tokens)
        done = await _outcome(self.bridge, handle)
        completion = api.complete(_output(done), call, model.tokenizer)
        body = api.message_body(message_id, model.name, completion, input_tokens)
        return web.Response(body=api.dumps(body), content_type="application/json")

    async def _stream(
        self, request: web.Request, handle: Handle, call: api.MessageRequest, model: ServedModel,
        message_id: str, input_tokens: int,
    ) -> web.StreamResponse:
        """SSE. Headers go out only once the wait outlasts a ping interval, so a request that
        fails fast still gets a real status (a 529 the SDK can retry); after that, a failure
        is an ``error`` event, and each further interval of waiting sends a ``ping``."""
        response: web.StreamResponse | None = None
        try:
            while not (await asyncio.wait((handle.future,), timeout=self.ping_interval))[0]:
                if response is None:
                    response = await _open_stream(request, api.stream_start(message_id, model.name, input_tokens))
                await response.write(api.PING)
            try:
                completion = api.complete(_output(handle.future.result()), call, model.tokenizer)
            except Exception as exc:  # noqa: BLE001 - once the stream is open, an error event ends it
                if response is None:
                    raise
                await response.write(api.stream_error(exc))
                return response
            if response is None:
                response = await _open_stream(request, api.stream_start(message_id, model.name, input_tokens))
            await response.write(api.stream_end(completion))
            await response.write_eof()
            return response
        except ConnectionResetError:  # the client left mid-stream; nothing more to tell it
            if response is None:
                raise
            return response
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone

    async def models(self, request: web.Request) -> web.Response:
        self.keys.authenticate(request.headers)
        return web.json_response(api.models_body(self.catalog.names(), self.created_at), dumps=_dumps)

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: this process answers, and its trio core still runs."""
        if not self.bridge.running:
            return _error(503, api.INTERNAL, "the scheduling core has stopped")
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: every model has at least one worker up. The body details each model."""
        models = {name: self._model_state(name) for name in self.catalog.names()} if self.bridge.running else {}
        waiting = [name for name, state in models.items() if not state["ready"]]
        if models and not waiting:
            return web.json_response({"ready": True, "models": models}, dumps=_dumps)
        why = f"no worker up for {', '.join(waiting)}" if waiting else "the scheduling core is not running"
        body = {**api.error_body(api.INTERNAL, f"not ready: {why}"), "ready": False, "models": models}
        return web.json_response(body, status=503, dumps=_dumps)

    def _model_state(self, name: str) -> dict:
        batcher = self.bridge.batcher(name)
        workers = batcher.pool.workers()
        stats = batcher.stats
        return {
            "ready": any(w.state is not SlotState.STARTING for w in workers),
            "workers": [{"slot": w.slot, "pid": w.pid, "state": w.state.value, "restarts": w.restarts}
                        for w in workers],
            "queued": batcher.queue.count,
            "flushed": stats.flushed_requests,
            "cancelled": stats.cancelled,
            "expired": stats.expired,
            "calls": stats.calls,
            "retries": stats.retries,
        }


async def _outcome(bridge: Bridge, handle: Handle) -> Request:
    """Wait for a request to finish; if the handler is cancelled (the client went away), the
    request is cancelled in the core: it leaves the queue, or its output is dropped."""
    try:
        return await handle.future
    finally:
        bridge.cancel(handle)


async def _open_stream(request: web.Request, first: bytes) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    await response.write(first)
    return response


def _output(request: Request) -> str:
    """The output of a finished request, or its error raised (Overloaded, RequestFailed)."""
    if request.state is State.DONE:
        return request.output  # type: ignore[return-value]
    raise request.error or RuntimeError(f"request ended {request.state.value}")


def _dumps(value: object) -> str:
    return api.dumps(value).decode()


def _error(status: int, kind: api.ErrorKind, message: str) -> web.Response:
    return web.Response(status=status, body=api.dumps(api.error_body(kind, message)), content_type="application/json")


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as ``{type:"error", error:{type, message}}`` with its table status."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status != 413:
            message = f"{request.method} {request.path[:200]}: {exc.reason.lower()}"
            return _error(exc.status, api.kind_for_status(exc.status), message)
        limit = request.app["ferry"].config.server.max_body_bytes
        error: BaseException = api.RequestTooLarge(f"body: over the limit of {limit} bytes")
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the one place an unexpected error becomes a 500
        if api.error_kind(exc) is api.INTERNAL:
            log.exception("unexpected error in %s %s", request.method, request.path)
        error = exc
    status, body, headers = api.error_response(error)
    return web.Response(status=status, body=body, headers=headers, content_type="application/json")


def make_app(config: FerryConfig, bridge: Bridge) -> web.Application:
    gateway = Gateway(config, bridge)
    app = web.Application(middlewares=[errors_as_json], client_max_size=config.server.max_body_bytes)
    app["ferry"] = gateway
    app.router.add_post("/v1/messages", gateway.messages)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    return app
