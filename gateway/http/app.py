"""The aiohttp application: routes (docs/http-api.md), and the one path a request takes.

    POST /v1/messages, /v1/chat/completions, /v1/completions   codec.parse ─> key ─> model ─> chat
         template ─> safety ─> context window ─> [Idempotency-Key] ─> admit: the key's limit (429)
         ─> core (529 / 503) ─> events ─> Answer ─> codec: JSON or SSE; the ledger bills, counts

Handlers are thin: wire formats are the codecs' (:mod:`gateway.wire`), identities, limits and
bills :mod:`gateway.accounting`'s, model names and aliases :mod:`gateway.ops.models`', and the
core is behind :class:`gateway.bridge.Bridge`. Every route shares :meth:`Gateway._serve`;
:meth:`Gateway.admit` is the one place a checked request passes to the core. Every error leaves
through :mod:`gateway.wire.errors` in its route's shape; a running request holds its version
(:class:`~gateway.ops.pins.Pins`), so a version taken out of service drains first."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import TypeVar

import msgspec
from aiohttp import web

from batcher.core.backend import Job
from gateway.accounting.auth import KeyRing, Principal
from gateway.accounting.idempotency import IdempotencyStore
from gateway.accounting.idempotency_redis import SharedIdempotencyStore
from gateway.accounting.ledger import Entry, Ledger, Outcome, outcome_of
from gateway.accounting.limiter import Limiter, open_limiter
from gateway.accounting.usage import UsageLog
from gateway.bridge import Bridge, Handle
from gateway.config import FerryConfig
from gateway.http import rows, service
from gateway.http.access_log import ENTRY, access_log
from gateway.http.connections import key_before_body, read_body
from gateway.http.request_id import (
    CLIENT_ID,
    LIMIT_HEADERS,
    REQUEST_ID,
    SHOULD_RETRY,
    name_the_request,
    request_id,
)
from gateway.metrics import Metrics
from gateway.ops.models import Catalog, ServedModel
from gateway.ops.pins import Pins
from gateway.text.answer import Answer
from gateway.text.safety import Blocklist, SafetyCheck
from gateway.tracing import Tracing, mark
from gateway.wire import anthropic, api, openai
from gateway.wire.anthropic import Messages
from gateway.wire.codec import Call, Codec, Head, LimitHeaders
from gateway.wire.errors import error_middleware

log = logging.getLogger("ferry.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CLIENT_CLOSED = 499  # the client went away before its answer (as nginx logs it)
T = TypeVar("T")


def open_idempotency(config: FerryConfig) -> IdempotencyStore:
    """Where idempotent answers live: shared through Redis where the limits are, else this
    gateway's SQLite file alone."""
    state, limits = config.state, config.limits
    path, ttl, most = state.path("idempotency.sqlite"), state.idempotency_ttl_s, state.idempotency_max_entries
    if limits.store == "redis":
        return SharedIdempotencyStore(path, limits.redis_url, limits.redis_timeout_ms / 1000, ttl, most)
    return IdempotencyStore(path, ttl, most)


class Gateway:
    """The state the handlers share: config, keys, models, the ledger, and the bridge to the core.
    A reload (:mod:`gateway.ops.rollout`) replaces ``config``, ``keys``, ``catalog`` and ``safety``,
    each whole, on this thread."""

    def __init__(self, config: FerryConfig, bridge: Bridge, limiter: Limiter, metrics: Metrics) -> None:
        self.metrics = metrics
        self.apply(config)
        self.bridge = bridge
        self.catalog = Catalog.of(config.models, config.aliases)
        self.ledger = Ledger(limiter, UsageLog(config.state.path("usage.sqlite")), metrics)
        self.idempotency = open_idempotency(config)
        self.pins = Pins()
        self.created = int(time.time())
        self.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))

    def apply(self, config: FerryConfig) -> None:
        """A configuration's keys (with their limits), safety stage and settings, for every
        request from now on (a reload: :mod:`gateway.ops.rollout`)."""
        self.config = config
        self.keys = KeyRing(config.keys)
        self.metrics.name_tenants(key.tenant for key in config.keys)
        self.safety: SafetyCheck = Blocklist(config.safety.blocklist, config.safety.refusal)

    async def close(self) -> None:
        """Flush the usage records and close the stores (the server is shutting down)."""
        self.ledger.usage.close()
        await self.idempotency.aclose()
        await self.ledger.limiter.aclose()

    async def admit(
        self, request: web.Request, codec: Codec, entry: Entry, model: ServedModel, job: Job
    ) -> Handle:
        """A request of one job passes to the core (:meth:`admit_each`)."""
        return (await self.admit_each(request, codec.limit_headers, entry, model, [job]))[0]

    async def admit_each(
        self, request: web.Request, limit_headers: LimitHeaders | None, entry: Entry, model: ServedModel,
        jobs: list[Job],
    ) -> list[Handle]:
        """The one place a checked request passes to the core: charge its key (429), then queue
        its jobs (a request of many inputs has one each: gateway/http/rows.py); the core sheds
        each at once (529) if its tier's wait budget cannot be met. The answer, whichever, shows
        the key's limits in the route's rate-limit headers (``limit_headers``: none, a route
        that has none)."""
        try:
            await self.ledger.charge(entry)
        finally:
            limits = entry.limits
            if limit_headers is not None and not limits.unlimited:
                plan = (limits.tokens_per_minute, limits.requests_per_minute)
                request[LIMIT_HEADERS] = limit_headers(plan, entry.limit_levels)
        handles = [self.bridge.submit(model.name, job) for job in jobs]  # the tier's budget is its deadline
        mark(request, "admitted")
        return handles

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Messages)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, openai.ChatCompletions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, openai.Completions)

    async def _serve(self, request: web.Request, route: type[Codec]) -> web.StreamResponse:
        """Every API's request path: only ``route`` (the codec) differs."""
        started = time.monotonic()
        principal = self.keys.authenticate(request.headers)
        body = await read_body(request, self.config.server.body_timeout_ms / 1000)
        codec = route.parse(body)
        call = codec.call
        model = self.catalog.resolve(call.model, call.session or principal.key_id)
        if (kind := model.config.outputs.kind) != "text":
            raise api.InvalidRequest(f"model: {model.name} answers with {kind}s, not text (docs/http-api.md)")
        prompt, prompt_tokens = self._prompt(call, model)
        if rule := self.safety.screen_input(prompt):
            self.metrics.safety_blocks.labels(model.name, "input").inc()
            raise api.InvalidRequest(f"messages: the input is refused by the safety policy ({rule})")
        window = model.config.context_window
        max_tokens = call.max_tokens
        if max_tokens is None:  # an OpenAI chat request's default, what its key is charged
            max_tokens = max(1, min(model.config.default_max_tokens, window - len(prompt_tokens)))
        if error := api.context_overflow(len(prompt_tokens), max_tokens, window):
            raise error
        if error := api.outside_vocabulary(call.sampling.logit_bias, model.tokenizer.vocab_size):
            raise error
        entry = Entry(
            request_id(request), principal.tenant, principal.key_id, principal.tier, model.name,
            principal.limits, len(prompt_tokens), max_tokens, started,
            client_request_id=request.get(CLIENT_ID),
        )
        request[ENTRY] = entry  # for the access log
        if model.name != call.model:  # an alias: count which version took it
            self.metrics.count_alias(call.model, model.name)
        job = Job(prompt, prompt_tokens, call.sampling.replace(max_tokens=max_tokens), principal.tier,
                  principal.tenant, stop_sequences=call.stop_sequences, stream=call.stream)
        self.pins.hold(model.name)
        try:
            if call.stream:
                return await self._settled(entry, self._stream(request, entry, codec, model, job))
            key = request.headers.get("Idempotency-Key")
            if key:
                scope = (principal.key_id, codec.idempotency_scope + key, body)
                return await self._settled(entry, self._idempotent(request, entry, scope, codec, model, job))
            return await self._settled(entry, self._whole(request, entry, codec, model, job))
        finally:
            self.pins.release(model.name)

    @staticmethod
    def _prompt(call: Call, model: ServedModel) -> tuple[str, list[int]]:
        """The prompt a model reads (a raw one, or the conversation through its chat template)
        and its tokens."""
        if call.prompt is not None:
            prompt = call.prompt
        else:
            prompt = model.template.render(call.system, call.turns, call.prefill)
        return prompt, model.tokenizer.encode(prompt)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: what a request's prompt would cost, run nowhere."""
        principal = self.keys.authenticate(request.headers)
        body = await read_body(request, self.config.server.body_timeout_ms / 1000)
        call = Messages(anthropic.parse_message_request(body, counting=True)).call
        _, tokens = self._prompt(call, self.catalog.resolve(call.model, call.session or principal.key_id))
        return web.json_response({"input_tokens": len(tokens)})  # the bytes it always had: spaced

    async def _idempotent(self, request: web.Request, entry: Entry, scope: tuple[str, str, bytes],
                          codec: Codec, model: ServedModel, job: Job) -> web.StreamResponse:
        """A whole answer under an ``Idempotency-Key``: computed once, replayed to every repeat.
        A repeat runs nothing and is recorded nowhere; its answer names the request it repeats."""
        entry.recorded = False

        async def run_once() -> tuple[int, bytes]:
            entry.recorded = True
            return await self._answer_whole(request, entry, codec, model, job)

        status, payload = await self.idempotency.run(*scope, run_once)
        if entry.recorded:
            return await self._write_whole(request, entry, status, payload)
        request[REQUEST_ID] = _ANSWER_ID.decode(payload).id
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

    def _answer(self, job: Job, model: ServedModel, streaming: bool) -> Answer:
        return Answer(job.stop_sequences, job.max_tokens, model.tokenizer, self.safety, streaming)

    @staticmethod
    def _head(entry: Entry) -> Head:
        return Head(entry.request_id, entry.model, entry.input_tokens, int(time.time()))

    async def _whole(self, request: web.Request, entry: Entry, codec: Codec,
                     model: ServedModel, job: Job) -> web.StreamResponse:
        status, payload = await self._answer_whole(request, entry, codec, model, job)
        return await self._write_whole(request, entry, status, payload)

    async def _answer_whole(
        self, request: web.Request, entry: Entry, codec: Codec, model: ServedModel, job: Job
    ) -> tuple[int, bytes]:
        """Wait for the whole answer; the status and JSON body to send (raises its error)."""
        handle = await self.admit(request, codec, entry, model, job)
        answer = self._answer(job, model, streaming=False)
        try:
            while not answer.done:
                answer.push(await handle.wait())
                mark(request, "first_event")
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone or a stop matched
        mark(request, "done")
        if answer.error is not None:
            request[SHOULD_RETRY] = answer.retryable
        completion = answer.completion()
        entry.cached_tokens = completion.cached_tokens
        self._count_blocked(answer, model)
        entry.stop_reason, entry.owed = completion.stop_reason, completion.output_tokens
        return 200, codec.whole(self._head(entry), completion, answer.blocked is not None)

    async def _write_whole(
        self, request: web.Request, entry: Entry, status: int, payload: bytes
    ) -> web.StreamResponse:
        """Send a whole answer, then count it delivered: latency and usage end at the last byte.
        A client that left as it was written (its connection already closing) is recorded as a
        stream's is: 499, cancelled, no output billed, and nothing for aiohttp to log."""
        response = web.Response(status=status, body=payload, content_type="application/json")
        self.ledger.bill_ahead(entry, status, entry.owed)  # billed before the client can have it
        mark(request, "first_byte")
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:
            entry.status, entry.outcome = CLIENT_CLOSED, Outcome.CANCELLED
            return response
        entry.delivered(entry.owed)
        entry.status, entry.outcome = status, Outcome.COMPLETED
        return response

    async def _stream(self, request: web.Request, entry: Entry, codec: Codec,
                      model: ServedModel, job: Job) -> web.StreamResponse:
        """SSE, a piece of text per event as it is released. Headers go out with the first text,
        or once the wait outlasts a ping interval, so a request that fails fast still gets a
        real status (a 429 or 529 the SDK can retry); after that a failure is the codec's error
        event, and each further interval of waiting sends its ping."""
        handle = await self.admit(request, codec, entry, model, job)
        answer = self._answer(job, model, streaming=True)
        encoder = codec.stream(self._head(entry))
        stream = _Stream(request, encoder.start())
        try:
            while not answer.done:
                events = await handle.wait(self.ping_interval)
                if not events:
                    await stream.send(encoder.ping)
                    continue
                mark(request, "first_event")
                piece = answer.push(events)
                if answer.done:
                    mark(request, "done")
                if answer.error is not None:
                    if not stream.open:
                        request[SHOULD_RETRY] = answer.retryable
                        raise answer.error  # nothing sent yet: the error's own status
                    entry.status = 200
                    entry.outcome = Outcome.INTERRUPTED if answer.parts else Outcome.FAILED
                    text = encoder.text(piece.text) if piece.text else b""  # before the error: it is billed
                    await stream.send(text + encoder.error(answer.error), end=True)
                elif answer.done:
                    self._count_blocked(answer, model)
                    entry.stop_reason, entry.cached_tokens = answer.stop_reason, answer.cached
                    text = encoder.text(piece.text)  # before the stop: it opens what the stop closes
                    stop = encoder.stop(
                        answer.stop_reason or "end_turn",
                        answer.stop_sequence,
                        answer.credited,
                        answer.blocked is not None,
                        answer.cached,
                    )
                    self.ledger.bill_ahead(entry, 200, piece.tokens)  # billed before the client has it all
                    await stream.send(text + stop, end=True)
                    entry.status, entry.outcome = 200, Outcome.COMPLETED
                elif piece.text:
                    await stream.send(encoder.text(piece.text))
                else:
                    continue
                entry.delivered(piece.tokens)
            assert stream.response is not None, "the answer's end was sent"
            return stream.response
        except ConnectionResetError:  # the client left mid-stream; nothing more to tell it
            entry.status, entry.outcome = CLIENT_CLOSED, Outcome.CANCELLED
            if stream.response is None:  # not open yet
                raise
            return stream.response
        finally:
            self.bridge.cancel(handle)  # a no-op once finished; else the client has gone or a stop matched

    @property
    def ping_interval(self) -> float:
        return self.config.server.ping_interval_ms / 1000

    def _count_blocked(self, answer: Answer, model: ServedModel) -> None:
        if answer.blocked is not None:
            self.metrics.safety_blocks.labels(model.name, "output").inc()


GATEWAY = web.AppKey("ferry", Gateway)


class _Stream:
    """One SSE response, opened at its first write: the codec's opening bytes, then the rest."""

    __slots__ = ("request", "response", "start")

    def __init__(self, request: web.Request, start: bytes) -> None:
        self.request = request
        self.start = start
        self.response: web.StreamResponse | None = None

    @property
    def open(self) -> bool:
        return self.response is not None

    async def send(self, data: bytes, end: bool = False) -> None:
        """Write ``data`` (headers and the opening first, if not sent yet); ``end``: close it."""
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            mark(self.request, "first_byte")
            await self.response.prepare(self.request)
            data = self.start + data
        await self.response.write(data)
        if end:
            await self.response.write_eof()


class _AnswerId(msgspec.Struct):
    id: str


_ANSWER_ID = msgspec.json.Decoder(_AnswerId)  # the id of a stored answer, read without the rest


class _LiveKeys:
    """The keys in force now, for the check made before a body is read (a reload replaces them)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return self._gateway.keys.authenticate(headers)


def make_app(config: FerryConfig, bridge: Bridge, tracer: object = None) -> web.Application:
    """The application over a started bridge: its backends' counters are exported at /metrics.
    ``tracer``: an OpenTelemetry tracer to trace requests with (else the config's ``[tracing]``)."""
    metrics = Metrics()
    for model in config.models:
        metrics.track(model.name, config.queue().tiers, model.worker_hour_price)
    gateway = Gateway(config, bridge, open_limiter(config.limits, metrics.registry), metrics)
    limit = config.server.max_body_bytes
    traced = config.tracing
    tracing = Tracing(tracer) if tracer is not None else Tracing.from_config(
        traced.enabled, traced.service_name, traced.otlp_endpoint)
    logged = access_log(config.server.access_log_per_second, tracing)
    app = web.Application(middlewares=[logged, error_middleware(limit, SHOULD_RETRY)], client_max_size=limit)
    app[GATEWAY] = gateway
    app.on_response_prepare.append(name_the_request)
    if tracing is not None:
        app.on_response_prepare.append(tracing.traceparent)
    app.on_cleanup.append(lambda _: gateway.close())
    expect = key_before_body(_LiveKeys(gateway), limit)
    app.router.add_post("/v1/messages", gateway.messages, expect_handler=expect)
    app.router.add_post("/v1/messages/count_tokens", gateway.count_tokens, expect_handler=expect)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions, expect_handler=expect)
    app.router.add_post("/v1/completions", gateway.completions, expect_handler=expect)
    service.add_routes(app, gateway)  # /metrics, /v1/models, /healthz, /readyz
    rows.add_routes(app, gateway, expect)  # /v1/embeddings and the Open Inference Protocol
    return app
