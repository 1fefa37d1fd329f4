"""The gateway in this process: the real aiohttp app and the real bridge, with the trio core on
its own thread, served by aiohttp's ``TestServer`` on loopback. Not a test module.

Where a subprocess adds nothing (the app's branches, the event path, chat templates), this is
faster and lets a test hand the core a backend of its own. ``ScriptedBackend`` plays a script per
job the way an engine streams: one event per job per tick, every live job in the same tick, so
deltas of many requests interleave and each tick's events cross the bridge together.

A job's script is its last user message (the labelled template's last ``User: `` line):

    say:Hel|lo |world      Started, a Delta per piece, Finished("end_turn")
    fail-before            Failed at once (RequestFailed, not retryable), before any delta
    fail-after:a|b         the deltas, then Failed (retryable), saying how many tokens were sent
    hang                   Started, then nothing until cancelled

A delta's tokens are its UTF-8 bytes, so counts agree with the ``bytes`` tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import trio
from aiohttp.test_utils import TestClient, TestServer

from batcher.core.admission import BatchLoad
from batcher.core.backend import Delta, Failed, Finished, Job, Snapshot, Started, Status, Usage
from batcher.core.errors import RequestFailed
from batcher.fixed.counters import BatchCounters
from gateway.bridge import Bridge
from gateway.config import parse_config
from gateway.http.app import make_app

KEY = "sk-harness-paid-01"

CONFIG = f"""
[server]
ping_interval_ms = 50

[[tiers]]
name = "paid"

[[keys]]
key = "{KEY}"
tenant = "harness"
tier = "paid"

[[models]]
name = "scripted@1"
aliases = ["scripted"]
worker = ["echo"]
"""


@dataclasses.dataclass
class _Play:
    job: Job
    on_event: object
    events: list
    hold: bool = False  # stays live once its events are played, until cancelled
    cancelled: bool = False


class ScriptedBackend:
    """The Backend protocol, playing each job's script one event per tick."""

    def __init__(self, tick: float = 0.002) -> None:
        self.tick = tick
        self.playing: list[_Play] = []
        self.cancelled: list[str] = []  # prompts of the jobs whose callers left
        self.ticks = 0
        self.queue = None  # the queue settings of the last retune
        self.closed = False  # the core has closed it

    def submit(self, job: Job, on_event) -> _Play:
        script = job.prompt.rsplit("User: ", 1)[-1]
        play = _Play(job, on_event, _script(script, len(job.prompt_tokens)), hold=script == "hang")
        self.playing.append(play)
        return play

    def cancel(self, play: _Play) -> None:
        play.cancelled = True
        self.cancelled.append(play.job.prompt)

    def retune(self, queue) -> None:
        self.queue = queue

    def snapshot(self) -> Snapshot:
        status = Status(True, "", (), len(self.playing), "requests")
        return Snapshot("fixed", status, BatchCounters(), BatchLoad((0,), (), 1, 0.0))

    async def run(self) -> None:
        while True:
            await trio.sleep(self.tick)  # the scripted engine's step: its simulated work, not a wait
            self.ticks += 1
            for play in self.playing:
                if not play.cancelled and play.events:
                    play.on_event(play.events.pop(0))
            self.playing = [p for p in self.playing if (p.events or p.hold) and not p.cancelled]


def _script(text: str, input_tokens: int) -> list:
    kind, _, rest = text.partition(":")
    pieces = [p for p in rest.split("|") if p]
    deltas = [Delta(p, len(p.encode())) for p in pieces]
    sent = sum(d.tokens for d in deltas)
    if kind == "say":
        return [Started(0.0), *deltas, Finished("end_turn", Usage(input_tokens, 0, sent))]
    if kind == "fail-before":
        return [Failed(RequestFailed("the input failed on its own"), retryable=False)]
    if kind == "fail-after":
        return [
            Started(0.0),
            *deltas,
            Failed(RequestFailed("the worker was lost"), retryable=True, tokens_sent=sent),
        ]
    if kind == "hang":
        return [Started(0.0)]
    raise ValueError(f"unknown script {text!r}")


@contextlib.asynccontextmanager
async def playing(backend: ScriptedBackend):
    """A scripted backend, running its ticks, for as long as the core keeps it open."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(backend.run)
        yield backend
        nursery.cancel_scope.cancel()
    backend.closed = True


@contextlib.asynccontextmanager
async def in_process(backend: ScriptedBackend, config: str = CONFIG, state_dir: str | None = None,
                     others: dict | None = None, tracer: object = None):
    """A started bridge over ``backend`` (as model ``scripted@1``) and a client for its app.
    ``others`` are the backends of other versions by name, or what opens one (a function
    returning an async context manager); ``tracer`` an OpenTelemetry tracer for the app."""
    if state_dir is not None:
        config += f'\n[state]\ndir = "{state_dir}"\n'
    parsed = parse_config(config)
    backends = {"scripted@1": backend, **(others or {})}

    def launch(model, queue):
        found = backends[model.name]
        return playing(found) if isinstance(found, ScriptedBackend) else found()

    bridge = Bridge(launch, parsed.models, parsed.queue())
    await bridge.start()
    client = TestClient(TestServer(make_app(parsed, bridge, tracer)))
    await client.start_server()
    try:
        yield client, bridge
    finally:
        await client.close()
        await bridge.stop()


def run(body, timeout: float = 30):
    """``asyncio.run`` a test body (pytest-trio owns async tests here)."""
    return asyncio.run(asyncio.wait_for(body(), timeout))


def message(text: str, **fields) -> dict:
    return {"model": "scripted", "max_tokens": 100, "messages": [{"role": "user", "content": text}], **fields}


def headers() -> dict[str, str]:
    return {"x-api-key": KEY}


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """Every server-sent event of a stream, as (name, data)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events
