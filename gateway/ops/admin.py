"""The admin interface: reload, drain, weights and status, on a Unix socket with its own token.

    GET  /status                                  each version's state, workers, requests in flight;
                                                  each alias's split (in effect, and the file's)
    POST /reload                                  re-read the config file and apply it (as SIGHUP does)
    POST /drain    {"model": "m@1"}               out of service, drained, workers stopped
    POST /weights  {"alias": "m", "weights": {"m@1": 100, "m@2": 0}}   a new split, at once

A Unix socket (0600, in the private state directory) is never on the network, and the token
(``[admin] token_sha256``, or one drawn at start into ``admin.token``) keeps out a process that
can reach the file but was not given it (docs/operations.md). Answers are JSON, ``{"result"}``
or ``{"error"}`` with 400, 401, 404 (no such version or alias) or 409 (a new version failed)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web

from gateway.config import ADMIN_TOKEN, FerryConfig
from gateway.ops.rollout import ReloadFailed, Rollout

log = logging.getLogger("ferry.admin")

ROLLOUT = web.AppKey("rollout", Rollout)


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def admin_app(rollout: Rollout, token_sha256: str) -> web.Application:
    app = web.Application(middlewares=[_checked(token_sha256)], client_max_size=64 * 1024)
    app[ROLLOUT] = rollout
    app.router.add_get("/status", _answered(_status))
    app.router.add_post("/reload", _answered(_reload))
    app.router.add_post("/drain", _answered(_drain))
    app.router.add_post("/weights", _answered(_weights))
    return app


def _answered(
    handler: Callable[[web.Request], Awaitable[object]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A route whose handler's result is the answer's ``result`` (its errors: :func:`_checked`)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"result": await handler(request)})

    return answer


def _checked(token_sha256: str):
    expected = bytes.fromhex(token_sha256)

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        try:
            if scheme.lower() != "bearer" or not hmac.compare_digest(presented, expected):
                raise AdminError(401, "admin: a valid admin token is required (Authorization: Bearer ...)")
            return await handler(request)
        except AdminError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        except web.HTTPException as exc:
            return web.json_response(
                {"error": f"{request.method} {request.path[:100]}: {exc.reason.lower()}"}, status=exc.status
            )

    return middleware


async def _status(request: web.Request) -> dict:
    return await request.app[ROLLOUT].status()


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The rollout's refusals as admin answers: no such thing (404), not now or not so (400)."""
    try:
        yield
    except ReloadFailed as exc:
        raise AdminError(409, str(exc)) from None
    except LookupError as exc:
        raise AdminError(404, str(exc)) from None
    except ValueError as exc:
        raise AdminError(400, str(exc)) from None


async def _reload(request: web.Request) -> str:
    with _refusals():
        return await request.app[ROLLOUT].reload()


async def _drain(request: web.Request) -> str:
    body = await _body(request)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise AdminError(400, "model: expected a version name")
    with _refusals():
        return await request.app[ROLLOUT].drain(model)


async def _weights(request: web.Request) -> str:
    body = await _body(request)
    alias, weights = body.get("alias"), body.get("weights")
    if not isinstance(alias, str) or not alias:
        raise AdminError(400, "alias: expected an alias name")
    if not (
        isinstance(weights, dict)
        and weights
        and all(
            isinstance(w, int | float) and not isinstance(w, bool) and 0 <= w < math.inf
            for w in weights.values()
        )
    ):
        raise AdminError(
            400, f"weights: expected {{version: weight >= 0, ...}}, got {json.dumps(weights)[:200]}"
        )
    with _refusals():
        return request.app[ROLLOUT].set_weights(alias, weights)


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise AdminError(400, "body: expected a JSON object")
    return body


async def start_admin(rollout: Rollout, config: FerryConfig) -> web.AppRunner:
    """Listen on the admin socket (refusing one another live ferry owns); return the runner."""
    path = config.admin_socket()
    digest = config.admin.token_sha256 or _draw_token(config.state.path(ADMIN_TOKEN))
    if os.path.exists(path):  # noqa: ASYNC240 - one stat of a local path, at start-up
        if _answers(path):
            raise RuntimeError(f"admin socket {path} is in use by another ferry serve; set [admin] socket")
        os.unlink(path)  # left by a ferry that did not stop cleanly
    runner = web.AppRunner(admin_app(rollout, digest), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    os.chmod(path, 0o600)
    return runner


def _draw_token(path: str) -> str:
    """A fresh token in a file only this user can read; its sha256."""
    token = secrets.token_urlsafe(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(descriptor, 0o600)
        file.write(token + "\n")
    return hashlib.sha256(token.encode()).hexdigest()


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def reload_on_signal(rollout: Rollout, announce: Callable[[str], None]) -> Callable[[], None]:
    """SIGHUP's handler: the same reload as ``ferry reload``, its outcome announced."""
    running: set[asyncio.Task] = set()

    async def reload() -> None:
        try:
            announce(f"ferry serve: {await rollout.reload()}")
        except (ValueError, ReloadFailed) as exc:
            announce(f"ferry serve: reload refused: {exc}")

    def handler() -> None:
        task = asyncio.ensure_future(reload())
        running.add(task)
        task.add_done_callback(running.discard)

    return handler

