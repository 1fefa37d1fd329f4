"""One access log line per request as it ends, on ``ferry.access`` at INFO: its id (and the
client's), method, path, the status the client got, the model version, tier, outcome, tokens
(prompt, of them cached, output) and times (first token, total). Never a key, a prompt or an
answer. Past ``access_log_per_second`` lines in a second the rest are counted into the next line
written (``unlogged``), so a flood costs the log a bounded number of lines (0: none at all).

The same middleware, the outermost, names the request for every log line its task writes
(:data:`gateway.log_format.REQUEST`) and, where tracing is on, opens and closes its span."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from gateway.accounting.ledger import Entry
from gateway.http.request_id import CLIENT_ID, request_id
from gateway.log_format import REQUEST
from gateway.logs import Throttle
from gateway.tracing import Tracing

log = logging.getLogger("ferry.access")
ENTRY = web.RequestKey("entry", Entry)  # the ledger's account of a request that got that far
CLIENT_CLOSED = 499


def access_log(per_second: int, tracing: Tracing | None = None):
    """The middleware (see the module's docstring)."""
    throttle = Throttle(interval=1.0, burst=per_second)

    @web.middleware
    async def logged(request: web.Request, handler) -> web.StreamResponse:
        started = time.monotonic()
        token = REQUEST.set(request_id(request))
        if tracing is not None:
            tracing.begin(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            # the line's fields only for a line written or a span: past the throttle's lines in a
            # second (most requests under load) a request costs the log one counter's step
            unlogged = throttle.admit() if per_second else None
            if tracing is not None or unlogged is not None:
                fields = _fields(request, status, time.monotonic() - started)
                if tracing is not None:
                    tracing.end(request, _attributes(fields))
                if unlogged is not None:
                    log.info(_line(fields, unlogged), extra={"fields": {**fields, "unlogged": unlogged}})
            REQUEST.reset(token)

    return logged


def _fields(request: web.Request, status: int, total: float) -> dict[str, object]:
    """What the line says of the request, from its ledger entry where it has one."""
    entry = request.get(ENTRY)
    fields: dict[str, object] = {
        "request_id": request_id(request), "client_request_id": request.get(CLIENT_ID),
        "method": request.method, "path": request.path[:200],
        "status": entry.status if entry is not None and entry.recorded else status,
        "total_ms": round(total * 1000, 1),
    }
    if entry is not None:
        ttft = None if entry.first_token_at is None else entry.first_token_at - entry.started
        fields.update(model=entry.model, tier=entry.tier, outcome=entry.outcome.value,
                      input_tokens=entry.input_tokens, cached_tokens=entry.cached_tokens,
                      output_tokens=entry.output_tokens, stop_reason=entry.stop_reason,
                      ttft_ms=None if ttft is None else round(ttft * 1000, 1))
    return fields


def _line(fields: dict[str, object], unlogged: int) -> str:
    words = [f"{name}={value}" for name, value in fields.items() if value is not None]
    return " ".join(words + ([f"unlogged={unlogged}"] if unlogged else []))


def _attributes(fields: dict[str, object]) -> dict[str, object]:
    """The access line's fields as the request span's attributes (OpenTelemetry's names)."""
    return {"http.request.method": fields["method"], "url.path": fields["path"],
            "http.response.status_code": fields["status"], "ferry.request_id": fields["request_id"],
            "ferry.client_request_id": fields["client_request_id"], "ferry.model": fields.get("model"),
            "ferry.tier": fields.get("tier"), "ferry.outcome": fields.get("outcome"),
            "gen_ai.usage.input_tokens": fields.get("input_tokens"),
            "gen_ai.usage.output_tokens": fields.get("output_tokens"),
            "ferry.cached_tokens": fields.get("cached_tokens")}
