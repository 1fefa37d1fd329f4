"""Every error in its route's shape.

Each route has one API, so its errors take that API's shape: Anthropic's ``{type:"error",
error:{type, message}}`` on ``/v1/messages`` (and every route outside the APIs), OpenAI's
``{error:{message, type, param, code}}`` on ``/v1/chat/completions`` and ``/v1/completions``.
``GET /v1/models`` is the one route both share: it answers in Anthropic's shape when the
request carries ``anthropic-version`` (every Anthropic SDK request does), else in OpenAI's. The
status comes from the one table, :data:`gateway.wire.api.ERRORS`, whichever shape carries it.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from gateway.wire import api, oip, openai
from gateway.wire.anthropic import Messages
from gateway.wire.codec import ErrorShape
from gateway.wire.embeddings import Embeddings

log = logging.getLogger("ferry.gateway")

OPENAI_ROUTES: dict[str, type[ErrorShape]] = {
    "/v1/chat/completions": openai.ChatCompletions,
    "/v1/completions": openai.Completions,
    "/v1/embeddings": Embeddings,
}
ANTHROPIC_VERSION = "anthropic-version"  # the header every Anthropic SDK request carries


def speaks_anthropic(request: web.Request) -> bool:
    return ANTHROPIC_VERSION in request.headers


def error_shape(request: web.Request) -> type[ErrorShape]:
    """Whose error shape a request gets: its route's (the Open Inference Protocol's under
    ``/v2/``); on ``/v1/models`` OpenAI's unless the client speaks Anthropic; Anthropic's
    everywhere else (the first API ferry served)."""
    if request.path.startswith("/v2/") or request.path == "/v2":
        return oip.Infer
    route = OPENAI_ROUTES.get(request.path)
    if route is None and request.path.startswith("/v1/models") and not speaks_anthropic(request):
        route = openai.ChatCompletions
    return route or Messages


def error_middleware(max_body_bytes: int, should_retry: web.RequestKey[bool]):
    """The middleware every error leaves through, whoever raises it (aiohttp included); it notes
    whether a retry may succeed under ``should_retry``, unless the handler knew better."""

    @web.middleware
    async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status != 413:
                message = f"{request.method} {request.path[:200]}: {exc.reason.lower()}"
                status, body = error_shape(request).error_reply(api.kind_for_status(exc.status), message)
                return web.Response(status=status, body=body, content_type="application/json")
            error: BaseException = api.body_too_large(max_body_bytes)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if api.error_kind(exc) is api.INTERNAL:
                log.exception("unexpected error in %s %s", request.method, request.path)
            error = exc
        request.setdefault(should_retry, api.should_retry(error))
        status, body, headers = error_shape(request).error_response(error)
        response = web.Response(status=status, body=body, headers=headers, content_type="application/json")
        if isinstance(error, api.UnreadableBody):
            response.force_close()
        return response

    return errors_as_json
