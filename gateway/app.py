"""The aiohttp application: routes, and the path a request takes to the core and back.

    POST /v1/messages  key ─> body ─> checked request ─> model ─> chat template ─> safety
                       ─> tokens within the context window ─> [Idempotency-Key: replay or wait]
                       ─> admit: key's limit (429) ─> core (529) ─> events ─> Answer (max_tokens,
                       stop sequences, output safety) ─> JSON or SSE; the ledger refunds, bills, counts
    GET  /v1/models    the served versions        GET /healthz   the process answers
    GET  /readyz       every model's fleet is ready to serve (JSON detail per model)
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
import json
import logging
import os
import time
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from batcher.backend import Job, Sampling
from batcher.config import FerryConfig
from batcher.metrics import Metrics
from gateway import api
from gateway.answer import Answer
from gateway.auth import KeyRing
from gateway.bridge import Bridge, Handle
from gateway.connections import key_before_body, read_body
from gateway.idempotency import IdempotencyStore
from gateway.ledger import Entry, Ledger, Outcome, outcome_of
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

    async def admit(self, entry: Entry, model: ServedModel, job: Job) -> Handle:
        """The one place a checked request passes to the core: charge its key (429), then queue
        it; the core sheds it at once (529) if its tier's wait budget cannot be met."""
        await self.ledger.charge(entry)
        return self.bridge.submit(model.name, job)  # the tier's budget is its deadline

    async def messages(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        principal = self.keys.authenticate(request.headers)
        body = await read_body(request, self.config.server.body_timeout_ms / 1000)
        call = api.parse_message_request(body)
        model = self.catalog.resolve(call.model)
        prompt = model.template.render(call.system, call.messages)
        if rule := self.safety.screen_input(prompt):
            self.metrics.safety_blocks.labels(model.name, "input").inc()
            raise api.InvalidRequest(f"messages: the input is refused by the safety policy ({rule})")
        prompt_tokens = model.tokenizer.encode(prompt)
        if error := api.context_overflow(len(prompt_tokens), call.max_tokens, model.config.context_window):
            raise error
        entry = Entry(
            f"{self._id_prefix}{next(self._ids)}", principal.tenant, principal.key_id, principal.tier,
            model.name, principal.limits, len(prompt_tokens), call.max_tokens, started,
        )
        request[REQUEST_ID] = entry.request_id  # every answer names it (the request-id header)
        sampling = Sampling(call.temperature, call.top_p, call.top_k)
        job = Job(prompt, prompt_tokens, call.max_tokens, principal.tier, principal.tenant,
                  sampling=sampling, stop_sequences=call.stop_sequences, stream=call.stream)
        if call.stream:
            return await self._settled(entry, self._stream(request, entry, call, model, job))
        key = request.headers.get("Idempotency-Key")
        if key:
            work = self._idempotent(request, entry, (principal.key_id, key, body), call, model, job)
            return await self._settled(entry, work)
        return await self._settled(entry, self._whole(request, entry, call, model, job))

    async def _idempotent(self, request: web.Request, entry: Entry, scope: tuple[str, str, bytes],
                          call: api.MessageRequest, model: ServedModel, job: Job) -> web.StreamResponse:
        """A whole answer under an ``Idempotency-Key``: computed once, replayed to every repeat.
        A repeat runs nothing and is recorded nowhere; its answer names the request it repeats."""
        entry.recorded = False

        async def run_once() -> tuple[int, bytes]:
            entry.recorded = True
            return await self._answer_whole(entry, call, model, job)

        status, payload = await self.idempotency.run(*scope, run_once)
        if entry.recorded:
            return await self._write_whole(request, entry, status, payload)
        request[REQUEST_ID] = json.loads(payload)["id"]
        return web.Response(status=status, body=payload, content_type="application/json")

    async def _settled(self, entry: Entry, work: Awaitable[T]) -> T:
        """Run a request's work and close its ledger entry whatever happens: refund, usage, metrics."""
        try:
            return await work
        except asyncio.CancelledError:
            entry.status, entry.outcome = CLIENT_CLOSED, Outcome.CANCELLED
            raise
        except Exception as exc:
            entry.status, entry.outcome = api.error_kind(exc).status, outcome_of(exc)
            raise
        finally:
            if entry.recorded:
                await self.ledger.close(entry)

    def _answer(self, call: api.MessageRequest, model: ServedModel, streaming: bool) -> Answer:
        return Answer(call.stop_sequences, call.max_tokens, model.tokenizer, self.safety, streaming)

    async def _whole(self, request: web.Request, entry: Entry, call: api.MessageRequest,
                     model: ServedModel, job: Job) -> web.StreamResponse:
        status, payload = await self._answer_whole(entry, call, model, job)
        return await self._write_whole(request, entry, status, payload)

    async def _answer_whole(self, entry: Entry, call: api.MessageRequest, model: ServedModel,
                            job: Job) -> tuple[int, bytes]:
        """Wait for the whole answer; the status and JSON body to send (raises its error)."""
        handle = await self.admit(entry, model, job)
        answer = self._answer(call, model, streaming=False)
        try:
            while not answer.done:
                answer.push(await handle.wait())
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone or a stop matched
        completion = answer.completion()
        self._count_blocked(answer, model)
        entry.stop_reason, entry.owed = completion.stop_reason, completion.output_tokens
        return 200, api.dumps(api.message_body(entry.request_id, model.name, completion, entry.input_tokens))

    async def _write_whole(self, request: web.Request, entry: Entry, status: int, payload: bytes) -> web.StreamResponse:
        """Send a whole answer, then count it delivered: latency and usage end at the last byte."""
        response = web.Response(status=status, body=payload, content_type="application/json")
        await response.prepare(request)
        await response.write_eof()
        entry.delivered(entry.owed)
        entry.status, entry.outcome = status, Outcome.COMPLETED
        return response

    async def _stream(self, request: web.Request, entry: Entry, call: api.MessageRequest,
                      model: ServedModel, job: Job) -> web.StreamResponse:
        """SSE, a ``content_block_delta`` per piece of text as it is released. Headers go out with
        the first text, or once the wait outlasts a ping interval, so a request that fails fast
        still gets a real status (a 429 or 529 the SDK can retry); after that a failure is an
        ``error`` event, and each further interval of waiting sends a ``ping``."""
        handle = await self.admit(entry, model, job)
        answer = self._answer(call, model, streaming=True)
        stream = _Stream(request, api.stream_start(entry.request_id, model.name, entry.input_tokens))
        try:
            while not answer.done:
                events = await handle.wait(self.ping_interval)
                if not events:
                    await stream.send(api.PING)
                    continue
                piece = answer.push(events)
                if answer.error is not None:
                    if not stream.open:
                        raise answer.error  # nothing sent yet: the error's own status
                    entry.status = 200
                    entry.outcome = Outcome.INTERRUPTED if answer.parts else Outcome.FAILED
                    await stream.write(piece.text, end=api.stream_error(answer.error))  # text first: it is billed
                elif answer.done:
                    self._count_blocked(answer, model)
                    entry.stop_reason = answer.stop_reason
                    stop = api.stream_stop(answer.stop_reason or "end_turn", answer.stop_sequence, answer.credited)
                    await stream.write(piece.text, stop, block=True)
                    entry.status, entry.outcome = 200, Outcome.COMPLETED
                elif piece.text:
                    await stream.write(piece.text)
                else:
                    continue
                entry.delivered(piece.tokens)
            return stream.response  # type: ignore[return-value]
        except ConnectionResetError:  # the client left mid-stream; nothing more to tell it
            entry.status, entry.outcome = CLIENT_CLOSED, Outcome.CANCELLED
            if not stream.open:
                raise
            return stream.response  # type: ignore[return-value]
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone or a stop matched

    def _count_blocked(self, answer: Answer, model: ServedModel) -> None:
        if answer.blocked is not None:
            self.metrics.safety_blocks.labels(model.name, "output").inc()

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text format: every ferry_* family (DESIGN §9)."""
        snapshots = await self.bridge.snapshots() if self.bridge.running else {}
        return web.Response(body=self.metrics.exposition(snapshots), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        self.keys.authenticate(request.headers)
        return web.json_response(api.models_body(self.catalog.names(), self.created_at), dumps=_dumps)

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: this process answers, and its trio core still runs."""
        if not self.bridge.running:
            return _error(503, api.INTERNAL, "the scheduling core has stopped")
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: every model's backend says so (fixed mode: a worker up, and a call answered
        since every slot last lost its worker). The body details each model."""
        snapshots = await self.bridge.snapshots() if self.bridge.running else {}
        models = {name: {"ready": snapshot.ready, **snapshot.status} for name, snapshot in snapshots.items()}
        waiting = [name for name, state in models.items() if not state["ready"]]
        if models and not waiting:
            return web.json_response({"ready": True, "models": models}, dumps=_dumps)
        why = f"no worker up for {', '.join(waiting)}" if waiting else "the scheduling core is not running"
        body = {**api.error_body(api.INTERNAL, f"not ready: {why}"), "ready": False, "models": models}
        return web.json_response(body, status=503, dumps=_dumps)


GATEWAY = web.AppKey("ferry", Gateway)
REQUEST_ID = web.RequestKey("request_id", str)  # the id an answer's usage record is filed under


class _Stream:
    """One SSE response, opened at its first write: ``message_start``, then whatever follows."""

    __slots__ = ("request", "start", "response", "block")

    def __init__(self, request: web.Request, start: bytes) -> None:
        self.request = request
        self.start = start
        self.response: web.StreamResponse | None = None
        self.block = False  # content_block_start sent

    @property
    def open(self) -> bool:
        return self.response is not None

    async def send(self, data: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
            data = self.start + data
        await self.response.write(data)

    async def write(self, text: str = "", end: bytes = b"", block: bool = False) -> None:
        """Write released text as a delta (the text block opened first, also when ``block``
        asks for it), then ``end`` (the stop events, or an error event) and close the stream."""
        parts = []
        if (text or block) and not self.block:
            self.block = True
            parts.append(api.BLOCK_START)
        if text:
            parts.append(api.text_delta(text))
        await self.send(b"".join((*parts, end)))
        if end:
            await self.response.write_eof()  # type: ignore[union-attr]


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
        limit = request.app[GATEWAY].config.server.max_body_bytes
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
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["request-id"] = request_id


def make_app(config: FerryConfig, bridge: Bridge) -> web.Application:
    """The application over a started bridge: its backends' counters are exported at /metrics."""
    metrics = Metrics()
    for model in config.models:
        metrics.track(model.name, config.queue().tiers)
    gateway = Gateway(config, bridge, open_limiter(config.limits, metrics.registry), metrics)
    app = web.Application(middlewares=[errors_as_json], client_max_size=config.server.max_body_bytes)
    app[GATEWAY] = gateway
    app.on_response_prepare.append(name_the_request)
    app.on_cleanup.append(lambda _: gateway.close())
    app.router.add_post("/v1/messages", gateway.messages, expect_handler=key_before_body(gateway.keys))
    app.router.add_get("/metrics", gateway.metrics_text)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    return app
