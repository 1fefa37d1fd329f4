"""The routes whose every input is a job of its own: ``POST /v1/embeddings`` and the Open Inference
Protocol v2 (docs/http-api.md), on the same admission, limits, idempotency and bills as the rest.

    body ─> Rows.parse ─> key ─> model (Rows.fits) ─> each input: tokens, safety, window
         ─> Gateway.admit_each: one charge (the inputs' tokens), a job per input ─> every job's
            output ─> Rows.whole: JSON ─> the ledger bills, counts, one usage record

A request answers once every one of its jobs has; the first to fail fails it (its error, in
the route's shape) and the others are taken back. A text model's outputs pass the safety stage
and its window as a chat answer's do. The OIP's health and metadata routes are here too.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from aiohttp import web

from batcher.core.backend import TERMINAL_EVENTS, Event, Failed, Job, Sampling, Vector
from gateway.accounting.ledger import Entry
from gateway.http.access_log import ENTRY
from gateway.http.connections import read_body
from gateway.http.request_id import CLIENT_ID, REQUEST_ID, request_id
from gateway.version import version
from gateway.wire import api, oip
from gateway.wire.codec import Head
from gateway.wire.embeddings import Embeddings
from gateway.wire.rows import Rows

if TYPE_CHECKING:  # the app imports this module to register its routes
    from gateway.bridge import Handle
    from gateway.http.app import Gateway


async def serve_rows(gateway: Gateway, request: web.Request, route: type[Rows], model_name: str | None = None
                     ) -> web.StreamResponse:
    """One request of a :class:`Rows` route: checked, priced, each input a job, answered whole."""
    started = time.monotonic()
    principal = gateway.keys.authenticate(request.headers)
    body = await read_body(request, gateway.config.server.body_timeout_ms / 1000)
    codec = route.parse(body, model_name)
    model = gateway.catalog.resolve(codec.model, codec.session or principal.key_id)
    config = model.config
    codec.fits(model.name, config.outputs, config.mode)
    text = config.outputs.kind == "text"
    jobs = []
    for index, (prompt, ids) in enumerate(zip(codec.inputs, map(model.tokenizer.encode, codec.inputs),
                                               strict=True)):
        if rule := gateway.safety.screen_input(prompt):
            gateway.metrics.safety_blocks.labels(model.name, "input").inc()
            raise api.InvalidRequest(f"input.{index}: the input is refused by the safety policy ({rule})")
        room = config.context_window - len(ids)
        if room < (1 if text else 0):
            raise api.InvalidRequest(f"input.{index}: {len(ids)} tokens, over {model.name}'s context window "
                                     f"of {config.context_window}")
        sampling = Sampling(max_tokens=max(1, room))  # a text's room to answer; an embedding uses none
        jobs.append(Job(prompt, tuple(ids), sampling, principal.tier, principal.tenant))
    input_tokens = sum(len(job.prompt_tokens) for job in jobs)
    max_tokens = sum(job.max_tokens for job in jobs) if text else 0
    entry = Entry(request_id(request, codec.id_prefix), principal.tenant, principal.key_id, principal.tier,
                  model.name, principal.limits, input_tokens, max_tokens, started,
                  client_request_id=request.get(CLIENT_ID))
    request[ENTRY] = entry  # for the access log
    if model.name != codec.model:
        gateway.metrics.count_alias(codec.model, model.name)
    gateway.pins.hold(model.name)
    try:
        key = request.headers.get("Idempotency-Key")
        if key is None:
            work = _answer(gateway, request, entry, codec, model, jobs)
            return await gateway._settled(entry, _written(gateway, request, entry, work))
        scope = (principal.key_id, codec.idempotency_scope + key, body)
        return await gateway._settled(entry, _idempotent(gateway, request, entry, scope, codec, model, jobs))
    finally:
        gateway.pins.release(model.name)


async def _written(gateway: Gateway, request: web.Request, entry: Entry, work) -> web.StreamResponse:
    status, payload = await work
    return await gateway._write_whole(request, entry, status, payload)


async def _idempotent(gateway: Gateway, request: web.Request, entry: Entry, scope: tuple[str, str, bytes],
                      codec: Rows, model,
                      jobs: list[Job]) -> web.StreamResponse:
    """Computed once per (key, Idempotency-Key), replayed to every repeat (which runs nothing and
    is recorded nowhere). The stored answer keeps the request id it was filed under first."""
    entry.recorded = False

    async def run_once() -> tuple[int, bytes]:
        entry.recorded = True
        status, payload = await _answer(gateway, request, entry, codec, model, jobs)
        return status, entry.request_id.encode() + b"\n" + payload

    key_id, idem_key, sent = scope
    status, stored = await gateway.idempotency.run(key_id, idem_key, sent, run_once)
    first_id, _, payload = stored.partition(b"\n")
    if entry.recorded:
        return await gateway._write_whole(request, entry, status, payload)
    request[REQUEST_ID] = first_id.decode()
    return web.Response(status=status, body=payload, content_type="application/json")


async def _answer(gateway: Gateway, request: web.Request, entry: Entry, codec: Rows, model, jobs: list[Job]
                  ) -> tuple[int, bytes]:
    """Every job's output, in order, once all have one; the first failure fails the request. A
    text passes through an :class:`~gateway.text.answer.Answer` (max_tokens, safety), a vector as is."""
    handles = await gateway.admit_each(request, codec.limit_headers, entry, model, jobs)
    text = model.config.outputs.kind == "text"
    outputs: list = []
    try:
        for job, handle in zip(jobs, handles, strict=True):
            events = await _ended(handle)
            if not text:
                outputs.append(next(event.data for event in events if isinstance(event, Vector)))
                continue
            answer = gateway._answer(job, model, streaming=False)
            answer.push(events)
            completion = answer.completion()
            gateway._count_blocked(answer, model)
            entry.owed += completion.output_tokens
            outputs.append(completion.text)
    finally:
        for handle in handles:
            gateway.bridge.cancel(handle)  # a no-op once finished; else one failed, or the client left
    entry.stop_reason = "end_turn"
    head = Head(entry.request_id, entry.model, entry.input_tokens, int(time.time()))
    return 200, codec.whole(head, outputs)


async def _ended(handle: Handle) -> list[Event]:
    """A job's events up to its last; its error raised if it failed."""
    events: list[Event] = []
    while not events or not isinstance(events[-1], TERMINAL_EVENTS):
        events += await handle.wait()
    if isinstance(events[-1], Failed):
        raise events[-1].error
    return events


# --- The Open Inference Protocol's other routes ---------------------------------------------


def _model_name(request: web.Request) -> str:
    """The model a ``/v2/models/{name}[/versions/{version}]/...`` URL names (``name@version``)."""
    name, version = request.match_info["name"], request.match_info.get("version")
    return f"{name}@{version}" if version else name


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(value).encode(), content_type="application/json")


class Protocols:
    """The handlers of the rows routes over one :class:`Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await serve_rows(self.gateway, request, Embeddings)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        return await serve_rows(self.gateway, request, oip.Infer, _model_name(request))

    async def model_metadata(self, request: web.Request) -> web.Response:
        principal = self.gateway.keys.authenticate(request.headers)
        asked = _model_name(request)
        model = self.gateway.catalog.resolve(asked, principal.key_id)
        return _json(oip.metadata(asked, model.name, model.config.outputs))

    async def model_ready(self, request: web.Request) -> web.Response:
        """200 ``{name, ready: true}`` while the model's fleet is ready; 400 (the protocol's
        "false") with the reason while it is not."""
        asked = _model_name(request)
        model = self.gateway.catalog.resolve(asked)
        snapshot = (await self._snapshots()).get(model.name)
        if snapshot is None or not snapshot.ready:
            why = snapshot.status.reason if snapshot is not None else "not open"
            status, body = oip.error_reply(api.ErrorKind(400, "invalid_request_error"), f"not ready: {why}")
            return web.Response(status=status, body=body, content_type="application/json")
        return _json({"name": asked, "ready": True})

    async def server_live(self, request: web.Request) -> web.Response:
        live = self.gateway.bridge.running
        return _json({"live": live}, 200 if live else 400)

    async def server_ready(self, request: web.Request) -> web.Response:
        snapshots = await self._snapshots()
        ready = bool(snapshots) and all(snapshot.ready for snapshot in snapshots.values())
        return _json({"ready": ready}, 200 if ready else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": oip.PLATFORM, "version": version(), "extensions": []})

    async def _snapshots(self) -> dict:
        return await self.gateway.bridge.snapshots() if self.gateway.bridge.running else {}


def add_routes(app: web.Application, gateway: Gateway, expect) -> None:
    """``POST /v1/embeddings`` and the OIP's routes, keyed as the other routes are (health is not)."""
    routes = Protocols(gateway)
    app.router.add_post("/v1/embeddings", routes.embeddings, expect_handler=expect)
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.router.add_post(base + "/infer", routes.infer, expect_handler=expect)
        app.router.add_get(base, routes.model_metadata)
        app.router.add_get(base + "/ready", routes.model_ready)
    app.router.add_get("/v2", routes.server_metadata)
    app.router.add_get("/v2/health/live", routes.server_live)
    app.router.add_get("/v2/health/ready", routes.server_ready)
