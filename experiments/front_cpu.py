"""What the HTTP front costs: the fixed route through the same trio core behind aiohttp or granian.

``ferry serve`` spends 0.38-0.50 ms of gateway CPU on each fixed-mode request
(experiments/docs/fixed-throughput.md). This prototype asks how much of that is the HTTP front
(accept, parse, write: aiohttp's Python in ferry) and what a compiled one (granian 2.8.7, its
HTTP/1.1 in Rust, the handler on the same asyncio loop) would save. One handler serves
``POST /v1/messages`` behind either front, the route's shape without its extras:

    key -> principal (KeyRing) -> the Anthropic codec's parse -> chat template -> tokens
    -> Job -> Bridge.submit (the same trio core, workers and admission) -> events -> Answer
    -> the codec's JSON body

It leaves out what ``ferry serve`` adds around that (rate limits, the usage journal, metrics,
request ids, access marks, the connection guard), so it is a floor for each front, not a
gateway. ``--bare`` answers a constant body at once, with no core: the front alone.

Measure it with ``experiments/http_load.py --url URL --pid PID`` (the URL and pid are printed),
one front at a time, as experiments/docs/fixed-throughput.md shows. granian is not a ferry
dependency: it runs from a scratch venv added to the path (``--granian-path``)::

    python -m venv /tmp/granian-venv && /tmp/granian-venv/bin/pip install granian==2.8.7
    .venv/bin/python -m experiments.front_cpu --front granian \\
        --granian-path /tmp/granian-venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from batcher.core.backend import Job
from experiments.http_load import fixed_only
from gateway.accounting.auth import KeyRing
from gateway.bridge import Bridge, open_backend
from gateway.config import FerryConfig, parse_config
from gateway.embedded_default import DEFAULT_TOML
from gateway.http import event_loop
from gateway.http.server import GC_THRESHOLDS
from gateway.text.answer import Answer
from gateway.text.chat import make_template
from gateway.text.safety import Blocklist
from gateway.text.tokenizer import make_tokenizer
from gateway.wire import api
from gateway.wire.anthropic import Messages
from gateway.wire.codec import Head

Handler = Callable[[Mapping[str, str], bytes], Awaitable[tuple[int, bytes]]]
BARE = b'{"type":"message","content":[{"type":"text","text":"ok"}]}'
JSON = "application/json"


class FixedRoute:
    """The fixed model's ``/v1/messages`` in the pieces a front assembles (the module docstring's
    chain): a body and a principal's tier and tenant into a ``Job``; its events into a body."""

    def __init__(self, config: FerryConfig) -> None:
        self.model = config.models[0]
        self.tokenizer = make_tokenizer(self.model.tokenizer)
        self.template = make_template(self.model.chat_template, self.model.tokenizer)
        self.safety = Blocklist(config.safety.blocklist, config.safety.refusal)
        self.served = 0

    def job(self, body: bytes, tier: str, tenant: str) -> tuple[Messages, Job]:
        """The checked request and its job; :class:`~gateway.wire.api.ApiError` if it is wrong."""
        codec = Messages.parse(body)
        call = codec.call
        prompt = self.template.render(call.system, call.turns, call.prefill)
        sampling = call.sampling.replace(max_tokens=call.max_tokens or 1)
        tokens = self.tokenizer.encode(prompt)
        return codec, Job(prompt, tokens, sampling, tier, tenant, stop_sequences=call.stop_sequences)

    def answer(self, job: Job) -> Answer:
        """What reads the job's events."""
        return Answer(job.stop_sequences, job.max_tokens, self.tokenizer, self.safety, False)

    def body(self, codec: Messages, job: Job, reply: Answer) -> bytes:
        """The finished answer's JSON; the job's error if it failed."""
        completion = reply.completion()
        self.served += 1
        head = Head(f"msg_{self.served}", self.model.name, len(job.prompt_tokens), 0)
        return codec.whole(head, completion, False)


def refusal(error: api.ApiError) -> tuple[int, bytes]:
    """A refused or failed request's status and (deliberately uninformative) body."""
    return api.error_kind(error).status, b'{"type":"error"}'


def fixed_route(config: FerryConfig, bridge: Bridge) -> Handler:
    """The route as one handler a request at a time: the key, then :class:`FixedRoute`'s pieces."""
    route = FixedRoute(config)
    keys = KeyRing(config.keys)

    async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, bytes]:
        try:
            principal = keys.authenticate(headers)
            codec, job = route.job(body, principal.tier, principal.tenant)
            handle = bridge.submit(route.model.name, job)
            reply = route.answer(job)
            while not reply.done:
                reply.push(await handle.wait())
            return 200, route.body(codec, job, reply)
        except api.ApiError as exc:
            return refusal(exc)

    return answer


async def bare(headers: Mapping[str, str], body: bytes) -> tuple[int, bytes]:
    """The front alone: a constant answer, no core."""
    return 200, BARE


def aiohttp_front(handler: Handler) -> web.Application:
    async def route(request: web.Request) -> web.Response:
        status, payload = await handler(request.headers, await request.read())
        return web.Response(status=status, body=payload, content_type=JSON)

    app = web.Application()
    app.router.add_post("/v1/messages", route)
    return app


class GranianFront:
    """An RSGI app (granian's native interface): the handler on granian's asyncio loop."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http" or scope.method != "POST" or scope.path != "/v1/messages":
            protocol.response_bytes(404, [], b"")
            return
        status, payload = await self.handler(scope.headers, await protocol())
        protocol.response_bytes(status, [("content-type", JSON)], payload)


def announce(front: str, port: int) -> None:
    print(f"front_cpu: {front} pid {os.getpid()} listening on http://127.0.0.1:{port}", flush=True)


async def serve_aiohttp(app: web.Application, front: str) -> None:
    """``app`` on a socket bound and listening before its URL is printed, until cancelled."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(4096)
    try:
        await web.SockSite(runner, listening, backlog=4096).start()
        announce(front, listening.getsockname()[1])
        await asyncio.Event().wait()  # until the process is stopped
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def main(args: argparse.Namespace) -> None:
    bridge = None
    handler: Handler = bare
    if not args.bare:
        config = parse_config(fixed_only(DEFAULT_TOML), "<front_cpu>")  # what http_load's ferry runs
        bridge = Bridge(open_backend, config.models, config.queue())
        await bridge.start()
        handler = fixed_route(config, bridge)
    gc.freeze()  # as ferry serve does once it is up: a collection scans only what requests leave
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        if args.front == "aiohttp":
            await serve_aiohttp(aiohttp_front(handler), args.front)
        else:
            from granian.constants import Interfaces, TaskImpl  # type: ignore[import-not-found]
            from granian.server.embed import Server  # type: ignore[import-not-found]

            port = free_port()
            server = Server(GranianFront(handler), port=port, interface=Interfaces.RSGI, backlog=4096,
                            log_access=False, log_level="warning", task_impl=TaskImpl(args.task_impl))
            announce(args.front, port)  # granian binds as it starts serving: a client retries until then
            await server.serve()
    finally:
        if bridge is not None:
            await bridge.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", choices=("aiohttp", "granian"), default="aiohttp")
    parser.add_argument("--bare", action="store_true", help="a constant answer, no core: the front alone")
    parser.add_argument("--task-impl", choices=("asyncio", "rust"), default="asyncio",
                        help="granian: the handler as an asyncio task, or driven from Rust (experimental)")
    parser.add_argument("--granian-path", help="site-packages holding granian (not a ferry dependency)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.granian_path:
        sys.path.append(arguments.granian_path)
    event_loop.run(main(arguments))  # uvloop, as ferry serve
