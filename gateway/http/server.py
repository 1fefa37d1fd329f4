"""``ferry serve``'s life cycle: start the core, listen, drain on SIGTERM, stop the core.

    start:    trio core (every model's workers ready) ─> bind ─> announce the address
    SIGTERM:  stop accepting ─> in-flight requests finish (up to shutdown_grace_ms)
              ─> those still waiting are answered "shutting down" (503 / a stream's error event)
              ─> cancel the trio core, which stops the workers ─> exit 0
    SIGHUP:   re-read the config file and apply it live (gateway/ops/rollout.py), as `ferry reload`
              does through the admin socket (gateway/ops/admin.py)

The core starts first, so a listening gateway can always serve; the core stops last, so no
accepted request loses its backend. :func:`_drain` bounds the wait for running handlers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from batcher.core.fleet import Launch
from batcher.placement.ray_actors import use_cluster
from gateway.bridge import Bridge, open_backend
from gateway.config import FerryConfig, default_config, load_config
from gateway.http import event_loop
from gateway.http.app import GATEWAY, make_app
from gateway.http.connections import ConnectionCollector, ConnectionGuard, GuardedSite
from gateway.log_format import FORMATS
from gateway.log_format import configure as configure_logs
from gateway.logs import hide_request_bytes
from gateway.ops.admin import reload_on_signal, start_admin
from gateway.ops.rollout import Rollout, leaves
from gateway.wire.api import ShuttingDown

log = logging.getLogger("ferry.serve")


async def serve(
    config: FerryConfig,
    announce: Callable[[str], None] = print,
    launch: Launch = open_backend,
    reread: Callable[[], FerryConfig] | None = None,
    source: str = "<embedded default>",
) -> int:
    """Run the gateway until SIGTERM or SIGINT (or the core dies); return an exit status.
    ``reread`` reads ``source`` again for a reload (SIGHUP, ``ferry reload``)."""
    hide_request_bytes()  # aiohttp would log a refused request's bytes: its key, its prompt
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    use_cluster(config.ray)  # joined when a `placement = "ray"` model first places a worker
    bridge = Bridge(launch, config.models, config.queue())
    try:
        try:
            await bridge.start()
        except Exception as exc:  # noqa: BLE001 - a bad worker argv, a model that fails to load...
            announce(f"ferry serve: the scheduling core did not start: {leaves(exc)}")
            return 1
        app = make_app(config, bridge)
        guard = ConnectionGuard(
            _connection_cap(config.server.max_connections), config.server.header_timeout_ms / 1000
        )
        app.middlewares.append(guard.track)
        app[GATEWAY].metrics.registry.register(ConnectionCollector(guard))
        rollout = Rollout(app[GATEWAY], reread or (lambda: config), source)
        try:
            admin = await start_admin(rollout, config)
        except (RuntimeError, OSError) as exc:
            announce(f"ferry serve: the admin socket did not open: {exc}")
            return 1
        app.on_shutdown.append(lambda _: admin.cleanup())
        app.on_shutdown.append(lambda _: rollout.aclose())
        app.on_shutdown.append(
            functools.partial(_drain, guard, bridge, config.server.shutdown_grace_ms / 1000)
        )
        loop.add_signal_handler(signal.SIGHUP, reload_on_signal(rollout, announce))
        runner = web.AppRunner(
            app,
            access_log=None,  # a log line per request costs more than the request's own work
            handler_cancellation=True,  # a client that leaves cancels its request in the core
            shutdown_timeout=ANSWER_WINDOW,  # after _drain: for what is left, then it is cut
            keepalive_timeout=config.server.idle_timeout_ms / 1000,
            # after an answer sent before the body was read (401, 408, 413), aiohttp reads and
            # drops the rest so the client sees the answer, not a reset: a body read like any other
            lingering_time=min(10.0, config.server.body_timeout_ms / 1000),
        )
        await runner.setup()
        try:
            site = GuardedSite(runner, guard, config.server.host, config.server.port, backlog=4096)
            await site.start()
            # Everything built so far lives as long as the process: move it out of the
            # collector's view, so a full collection scans only what requests leave behind.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            host, port = runner.addresses[0][:2]
            announce(f"ferry serve: listening on http://{host}:{port}")
            ended = asyncio.ensure_future(stop.wait())
            assert bridge.ended is not None, "the bridge has started"
            await asyncio.wait((ended, bridge.ended), return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            announce("ferry serve: draining in-flight requests")
        finally:
            await runner.cleanup()
    finally:
        await bridge.stop()
    error = bridge.ended.result() if bridge.ended is not None and bridge.ended.done() else None
    if error is not None and not stop.is_set():
        log.error("the scheduling core stopped: %r", error)
        return 1
    announce("ferry serve: stopped")
    return 0


ANSWER_WINDOW = 0.5  # seconds for the answers of requests refused at the end of the grace period
GC_THRESHOLDS = (20_000, 20, 20)
"""The cyclic collector's thresholds while serving (CPython's default: 700, 10, 10). Request
objects die by reference counting (no cycle per request: see ``Bridge._on_event``), yet each
young collection still walks every live young object, and at 1,600 requests/s a few hundred
requests are in flight: with the default, the collector took a sizeable share of the gateway's
CPU (experiments/docs/gateway-http.md). Collected far less often, what it finds is
the same few cycles, a little later."""


async def _drain(guard: ConnectionGuard, bridge: Bridge, grace: float, app: web.Application) -> None:
    """On SIGTERM, once the listener is closed: requests in flight get ``grace`` seconds to
    finish; then every one still waiting fails with :class:`~gateway.wire.api.ShuttingDown`, which
    its handler answers (a 503, or an ``error`` event ending a stream) and bills with that
    status, within :data:`ANSWER_WINDOW`. aiohttp then gets as long again for anything left
    (a slow reader) before it cuts the connection, so the drain takes grace + at most 1.5 s,
    where aiohttp's own waits took twice the grace and cut every request still waiting."""
    if not await guard.drained(grace):
        bridge.refuse_all(ShuttingDown(f"the server is shutting down: not done within {grace * 1000:.0f} ms"))
        await guard.drained(ANSWER_WINDOW)


def add_serve_command(commands) -> None:
    """``ferry serve [--config FILE] [--host H] [--port P] [--log-format text|json]``."""
    sub = commands.add_parser("serve", help="run the HTTP gateway (the embedded default with no --config)")
    sub.add_argument("--config", help="a TOML file (docs/configuration.md); default: the embedded default")
    sub.add_argument("--host", help="listen address (overrides [server].host)")
    sub.add_argument("--port", type=int, help="listen port, 0 for any free one (overrides [server].port)")
    sub.add_argument("--log-format", choices=FORMATS, default="text",
                     help="log lines as text, or as one JSON object a line with the request's id")
    sub.set_defaults(run=serve_command)


def _load(args) -> FerryConfig:
    """The configuration file (or the embedded default), with the command line's overrides."""
    config = load_config(args.config, os.environ) if args.config else default_config(os.environ)
    server = dataclasses.replace(
        config.server,
        host=args.host if args.host is not None else config.server.host,
        port=args.port if args.port is not None else config.server.port,
    )
    return dataclasses.replace(config, server=server)


def serve_command(args) -> int:
    """Load the configuration, then run :func:`serve` on uvloop (plain asyncio without it)."""
    configure_logs(args.log_format)
    try:
        config = _load(args)
    except (OSError, ValueError) as exc:
        print(f"ferry serve: {exc}", file=sys.stderr)
        return 2
    if not args.config:
        for key in config.keys:
            print(f"ferry serve: demo key for tier {key.tier}: {key.key}")
    _raise_open_file_limit()
    say = functools.partial(print, flush=True)
    running = serve(
        config, say, reread=functools.partial(_load, args), source=args.config or "<embedded default>"
    )
    return event_loop.run(running)


FD_RESERVE = 256  # descriptors kept for worker pipes, SQLite, Redis and the listening socket


def _connection_cap(configured: int) -> int:
    """``max_connections``, lowered to what the open-file limit leaves after :data:`FD_RESERVE`
    (with a warning), so that a flood meets the cap before accept() runs out of descriptors."""
    available = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_RESERVE
    if configured <= available:
        return configured
    log.warning(
        "max_connections %d is over the open-file limit less %d: using %d", configured, FD_RESERVE, available
    )
    return max(1, available)


def _raise_open_file_limit() -> None:
    """Each connection is a file descriptor: take the hard limit, not the shell's soft 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
