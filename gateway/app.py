"""The aiohttp application: routes, and the path a request takes to the core and back.

    POST /v1/messages  key ─> body ─> checked request ─> model ─> safety ─> context window
                       ─> [Idempotency-Key: replay or wait] ─> admit: key's limit (429) ─> core (529)
                       ─> output safety ─> answer; the ledger refunds, bills and counts it
    GET  /v1/models    the served versions        GET /healthz   the process answers
    GET  /readyz       every model has a worker up (JSON detail per model)
    GET  /metrics      Prometheus text format

Handlers are thin: rules live in :mod:`gateway.api` (pure), identities in :mod:`gateway.auth`,
model names in :mod:`gateway.models`, charges and bills in :mod:`gateway.ledger`, and the core
behind :class:`gateway.bridge.Bridge`. :meth:`Gateway.admit` is the one place a checked request
passes to the core. Every error, whoever raises it (aiohttp included), leaves through
:func:`errors_as_json` with the body and status of :data:`gateway.api.ERRORS`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from batcher.config import FerryConfig
from batcher.metrics import Metrics
from batcher.pool import SlotState
from batcher.types import Request, State
from gateway import api
from gateway.auth import KeyRing
from gateway.bridge import Bridge, Handle
from gateway.connections import key_before_body, read_body
from gateway.idempotency import IdempotencyStore
from gateway.ledger import Entry, Ledger
from gateway.limiter import Limiter, open_limiter
from gateway.models import Catalog, ServedModel
from gateway.safety import Blocklist, SafetyCheck
from gateway.usage import UsageLog

log = logging.getLogger("ferry.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CLIENT_CLOSED = 499  # the client went away before its answer (as nginx logs it)
T = TypeVar("T")


class Gateway:
    """The state the handlers share: config, keys, models, the ledger, and the bridge to the core."""

    def __init__(self, config: FerryConfig, bridge: Bridge, limiter: Limiter, metrics: Metrics) -> None:
        self.config = config
        self.bridge = bridge
        self.keys = KeyRing(config.keys)
        self.catalog = Catalog(config.models)
        self.metrics = metrics
        self.ledger = Ledger(limiter, UsageLog(config.state.path("usage.sqlite")), metrics)
        self.idempotency = IdempotencyStore(config.state.path("idempotency.sqlite"), config.state.idempotency_ttl_s,
                                            config.state.idempotency_max_entries)
        self.safety: SafetyCheck = Blocklist(config.safety.blocklist, config.safety.refusal)
        self.ping_interval = config.server.ping_interval_ms / 1000
        self.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._ids = itertools.count(1)
        self._id_prefix = f"msg_{os.getpid():x}{int(time.time()):x}_"

    async def close(self) -> None:
        """Flush the usage records and close the stores (the server is shutting down)."""
        self.ledger.usage.close()
        self.idempotency.close()
        await self.ledger.limiter.aclose()

    async def admit(self, entry: Entry, model: ServedModel, prompt: str) -> Handle:
        """The one place a checked request passes to the core: charge its key (429), then queue
        it; the core sheds it at once (529) if its tier's wait budget cannot be met."""
        await self.ledger.charge(entry)
        return self.bridge.submit(model.name, prompt, entry.tier)  # the tier's budget is its deadline

    async def messages(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        principal = self.keys.authenticate(request.headers)
        body = await read_body(request, self.config.server.body_timeout_ms / 1000)
        call = api.parse_message_request(body)
        model = self.catalog.resolve(call.model)
        prompt = api.render_prompt(call)
        if rule := self.safety.screen_input(prompt):
            self.metrics.safety_blocks.labels(model.name, "input").inc()
            raise api.InvalidRequest(f"messages: the input is refused by the safety policy ({rule})")
        input_tokens = model.tokenizer.count(prompt)
        if error := api.context_overflow(input_tokens, call.max_tokens, model.config.context_window):
            raise error
        entry = Entry(
            f"{self._id_prefix}{next(self._ids)}", principal.tenant, principal.key_id, principal.tier,
            model.name, principal.limits, input_tokens, call.max_tokens, started,
        )
        request["request_id"] = entry.request_id  # every answer names it (the request-id header)
        key = request.headers.get("Idempotency-Key")
        if key and not call.stream:
            status, payload = await self.idempotency.run(
                principal.key_id, key, body, lambda: self._settled(entry, self._whole(entry, call, model, prompt))
            )
            return web.Response(status=status, body=payload, content_type="application/json")
        if call.stream:
            return await self._settled(entry, self._stream(request, entry, call, model, prompt))
        status, payload = await self._settled(entry, self._whole(entry, call, model, prompt))
        return web.Response(status=status, body=payload, content_type="application/json")

    async def _settled(self, entry: Entry, work: Awaitable[T]) -> T:
        """Run a request's work and close its ledger entry whatever happens: refund, usage, metrics."""
        try:
            return await work
        except asyncio.CancelledError:
            entry.status = CLIENT_CLOSED
            raise
        except Exception as exc:
            entry.status = api.error_kind(exc).status
            raise
        finally:
            await self.ledger.close(entry)

    async def _whole(self, entry: Entry, call: api.MessageRequest, model: ServedModel, prompt: str) -> tuple[int, bytes]:
        done = await _outcome(self.bridge, await self.admit(entry, model, prompt))
        completion = self._complete(entry, _output(done), call, model)
        return 200, api.dumps(api.message_body(entry.request_id, model.name, completion, entry.input_tokens))

    def _complete(self, entry: Entry, output: str, call: api.MessageRequest, model: ServedModel) -> api.Completion:
        """The client's view of an output: screened by the safety stage, cut by the request's rules."""
        output, rule = self.safety.screen_output(output)
        if rule is not None:
            self.metrics.safety_blocks.labels(model.name, "output").inc()
        completion = api.complete(output, call, model.tokenizer)
        entry.delivered(completion.output_tokens)
        entry.status, entry.stop_reason = 200, completion.stop_reason
        return completion

    async def _stream(
        self, request: web.Request, entry: Entry, call: api.MessageRequest, model: ServedModel, prompt: str
    ) -> web.StreamResponse:
        """SSE. Headers go out only once the wait outlasts a ping interval, so a request that
        fails fast still gets a real status (a 429 or 529 the SDK can retry); after that, a
        failure is an ``error`` event, and each further interval of waiting sends a ``ping``."""
        handle = await self.admit(entry, model, prompt)
        start = api.stream_start(entry.request_id, model.name, entry.input_tokens)
        response: web.StreamResponse | None = None
        try:
            while not (await asyncio.wait((handle.future,), timeout=self.ping_interval))[0]:
                if response is None:
                    response = await _open_stream(request, start)
                await response.write(api.PING)
            try:
                completion = self._complete(entry, _output(handle.future.result()), call, model)
            except Exception as exc:  # noqa: BLE001 - once the stream is open, an error event ends it
                if response is None:
                    raise
                entry.status = api.error_kind(exc).status
                await response.write(api.stream_error(exc))
                return response
            if response is None:
                response = await _open_stream(request, start)
            await response.write(api.stream_end(completion))
            await response.write_eof()
            return response
        except ConnectionResetError:  # the client left mid-stream; nothing more to tell it
            entry.status = CLIENT_CLOSED
            if response is None:
                raise
            return response
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text format: every ferry_* family (DESIGN §9)."""
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

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
            "call_seconds": batcher.pool.call_seconds,  # recent call time: what admission plans with
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


async def name_the_request(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer to an admitted request, whole, streamed or an error, carries ``request-id``
    (as Anthropic's API does): the id its usage record and logs are filed under."""
    request_id = request.get("request_id")
    if request_id is not None:
        response.headers["request-id"] = request_id


def make_app(config: FerryConfig, bridge: Bridge) -> web.Application:
    """The application over a started bridge: its batchers' counters are exported at /metrics."""
    metrics = Metrics()
    for model in config.models:
        batcher = bridge.batcher(model.name)
        metrics.track(model.name, config.queue().tiers, batcher.stats, batcher.load)
    gateway = Gateway(config, bridge, open_limiter(config.limits, metrics.registry), metrics)
    app = web.Application(middlewares=[errors_as_json], client_max_size=config.server.max_body_bytes)
    app["ferry"] = gateway
    app.on_response_prepare.append(name_the_request)
    app.on_cleanup.append(lambda _: gateway.close())
    app.router.add_post("/v1/messages", gateway.messages, expect_handler=key_before_body(gateway.keys))
    app.router.add_get("/metrics", gateway.metrics_text)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    return app
