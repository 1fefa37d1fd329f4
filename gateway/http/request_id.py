"""What every response says about its request, errors included, whoever answered it (a handler,
the error middleware, the check made before a body is read):

    request-id, x-request-id   the request's id: the client's ``X-Request-Id`` when well formed
                               (1-128 of ``A-Z a-z 0-9 . _ : - + / = @``), else ferry's own
    x-should-retry             on an error: whether the same request may well succeed again
    anthropic-ratelimit-*, x-ratelimit-*   its key's limits, when the ledger charged it

Anthropic's API names every response ``request-id``; OpenAI's SDK reads ``x-request-id``. Both
SDKs obey ``x-should-retry`` over their own rule, which retries every 500 (and so a poison input
``max_attempts`` times again). ferry's own id (``msg_...``, ``chatcmpl-...``) is the one its usage
record and access log line are filed under; a client's id is echoed, and recorded beside it."""

from __future__ import annotations

import itertools
import re
import secrets
import time

from aiohttp import web

REQUEST_ID = web.RequestKey("request_id", str)  # ferry's id: usage records and logs are filed under it
CLIENT_ID = web.RequestKey("client_request_id", str)  # the client's X-Request-Id, when well formed
SHOULD_RETRY = web.RequestKey("should_retry", bool)  # what a handler or the error middleware knows
LIMIT_HEADERS = web.RequestKey("limit_headers", dict)  # the key's limits, once the ledger charged it
PREFIXES = {"/v1/messages": "msg_", "/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-"}
RETRIED_STATUSES = (408, 429, 503, 529)  # an error answered with no more said: retry these alone
_WELL_FORMED = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")
_COUNT = itertools.count(1)
_PROCESS = f"{secrets.token_hex(4)}{int(time.time()):x}_"  # this process's (never its pid: answers show it)


def request_id(request: web.Request, prefix: str | None = None) -> str:
    """The request's id, given at first asking: its route's prefix (``prefix``, else the one of
    its path), this process, a count."""
    found = request.get(REQUEST_ID)
    if found is None:
        prefix = PREFIXES.get(request.path, "req_") if prefix is None else prefix
        found = request[REQUEST_ID] = f"{prefix}{_PROCESS}{next(_COUNT)}"
        client = request.headers.get("X-Request-Id", "")
        if _WELL_FORMED.fullmatch(client):
            request[CLIENT_ID] = client
    return found


async def name_the_request(request: web.Request, response: web.StreamResponse) -> None:
    """The headers of the module's docstring, as the response's own go out."""
    shown = request.get(CLIENT_ID) or request_id(request)
    headers = response.headers
    headers["request-id"] = headers["x-request-id"] = shown
    if response.status >= 400 and "x-should-retry" not in headers:
        retry = request.get(SHOULD_RETRY)
        if retry is None:
            retry = response.status in RETRIED_STATUSES
        headers["x-should-retry"] = "true" if retry else "false"
    if limits := request.get(LIMIT_HEADERS):
        headers.update(limits)
