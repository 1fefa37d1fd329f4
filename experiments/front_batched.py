"""The core's side of T6: ferry's trio core fed whole batches by a compiled front.

``experiments/rust_front`` (Rust, hyper) accepts HTTP, checks the key and the body's size, and
sends the accepted requests over one Unix socket in frames: whatever arrived while its previous
frame was being written. This process runs the core ``experiments/front_cpu.py`` runs behind
aiohttp (``open_backend``, 8 reference workers of the embedded default's fixed model, admission
and tier queues, the collector set as ``ferry serve`` sets it) and
:class:`~experiments.front_cpu.FixedRoute`'s per-request steps (the Anthropic codec's parse, the
template, the tokens, the ``Job``; the events into an ``Answer``; the JSON body), but shares
what a batch can share. Two ways to reach the core (``--hop``):

- ``bridge`` (the default), as ``ferry serve`` is built: the socket on the asyncio loop, the
  core behind the same ``Bridge``. A frame's jobs are submitted in one pass of the loop, so
  they cross to the trio thread in one hop; no asyncio task or future waits on a request: the
  bridge's delivery of a trio wake-up's events is where the finished requests are answered, in
  one answer frame.
- ``none``: no asyncio loop and no bridge; a task of the trio core reads the socket and hands
  the jobs to the backend itself, and another writes the answers (:class:`TrioCore`).

Framing (both ways a 4-byte little-endian length, then msgpack): to the core
``[[[id, key index, body], ...], [cancelled id, ...]]``, to the front ``[[id, status, body], ...]``.
The key index is the line of the key's digest in the file the front was started with, in the
order of the config's ``[[keys]]``; the core maps it to the key's tier and tenant.

Kept from ferry: admission and its 529s, the tiers' queues and wait budgets, the workers' retries;
a client that goes away before its answer cancels its job (the front sends its id). Left out, as
in ``front_cpu.py``: per-key limits, the usage ledger and journal, metrics, request ids, the
access log, the connection guard's deadlines, streaming, a deadline on the whole request.

    experiments/rust_front/build.sh                # once (experiments/docs/fixed-throughput.md, T6)
    .venv/bin/python -m experiments.front_batched [--hop none]   # prints the URL and the pids

On SIGTERM it stops and prints how many requests came in how many frames (stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from batcher.core.backend import TERMINAL_EVENTS, Backend, Event, Job
from batcher.core.fleet import Fleet
from experiments.front_cpu import FixedRoute, refusal
from experiments.http_load import fixed_only
from gateway.bridge import Bridge, Handle, open_backend
from gateway.config import FerryConfig, parse_config
from gateway.embedded_default import DEFAULT_TOML
from gateway.http import event_loop
from gateway.http.server import GC_THRESHOLDS
from gateway.text.answer import Answer
from gateway.wire import api
from gateway.wire.anthropic import Messages

FRONT = pathlib.Path(__file__).resolve().parent / "rust_front" / "target" / "release" / "ferry-rust-front"
HEAD = struct.Struct("<I")
Requests = list[tuple[int, int, bytes]]  # (id, key index, body)
Answers = list[tuple[int, int, bytes]]  # (id, status, body)
FRAME = msgspec.msgpack.Decoder(tuple[Requests, list[int]])
ENCODER = msgspec.msgpack.Encoder()


def split_frames(buffer: bytearray) -> list[bytes]:
    """Take every whole frame's payload off the front of ``buffer``; a partial one stays."""
    frames = []
    start = 0
    while len(buffer) - start >= HEAD.size:
        (length,) = HEAD.unpack_from(buffer, start)
        end = start + HEAD.size + length
        if end > len(buffer):
            break
        frames.append(bytes(buffer[start + HEAD.size:end]))
        start = end
    del buffer[:start]
    return frames


def decode_frame(payload: bytes) -> tuple[Requests, list[int]]:
    """A frame from the front: the requests it accepted and the ids whose clients went away."""
    return FRAME.decode(payload)


def encode_answers(answers: Answers) -> bytes:
    """One frame to the front: its length, then the answers."""
    payload = ENCODER.encode(answers)
    return HEAD.pack(len(payload)) + payload


class Batches:
    """What both hops share: a frame's requests into jobs (or refusals), a finished job's events
    into its answer; and how many frames and requests came, to tell how much batching there was."""

    def __init__(self, route: FixedRoute, principals: list[tuple[str, str]], trace: bool = False) -> None:
        self.route = route
        self.trace = trace  # a line on stderr for each frame with requests
        self.principals = principals  # key index -> (tier, tenant)
        self.pending: dict[int, tuple[Messages, Answer, Job]] = {}  # by request id
        self.frames = self.requests = self.answer_frames = self.cancelled = 0

    def jobs(self, requests: Requests) -> tuple[list[tuple[int, Job]], Answers]:
        """Each request's job by its id, and the answers of those refused before the core."""
        self.frames += 1
        self.requests += len(requests)
        if self.trace and requests:
            print(f"front_batched: took {len(requests)}", file=sys.stderr, flush=True)
        accepted, refused = [], []
        route = self.route
        for rid, key, body in requests:
            tier, tenant = self.principals[key]
            try:
                codec, job = route.job(body, tier, tenant)
            except api.ApiError as exc:
                refused.append((rid, *refusal(exc)))
                continue
            self.pending[rid] = (codec, route.answer(job), job)
            accepted.append((rid, job))
        return accepted, refused

    def finish(self, rid: int, events: list[Event]) -> tuple[int, int, bytes] | None:
        """The answer of a job whose last event has come; None if its client went away."""
        entry = self.pending.pop(rid, None)
        if entry is None:
            return None
        codec, reply, job = entry
        reply.push(events)
        try:
            return rid, 200, self.route.body(codec, job, reply)
        except api.ApiError as exc:
            return rid, *refusal(exc)

    def drop(self, rid: int) -> bool:
        """Forget a request that will not be answered by its job; False if it was answered already."""
        return self.pending.pop(rid, None) is not None

    def cancel(self, rid: int) -> bool:
        """Forget a request whose client went away; False if it was answered already."""
        dropped = self.drop(rid)
        self.cancelled += dropped
        return dropped

    def report(self) -> str:
        return (f"front_batched: {self.requests} requests in {self.frames} frames "
                f"({self.requests / max(self.frames, 1):.2f} a frame), {self.answer_frames} answer frames, "
                f"{self.cancelled} cancelled")


class BatchedBridge(Bridge):
    """The bridge, telling :attr:`delivered` after each delivery of events (a private hook:
    an experiment's, so that no task or future waits on each request)."""

    delivered: Callable[[list[tuple[Handle, list[Event]]]], None] | None = None

    def _deliver(self, batch: list[tuple[Handle, list[Event]]]) -> None:
        super()._deliver(batch)
        if self.delivered is not None:
            self.delivered(batch)


class BridgedCore(asyncio.Protocol):
    """``--hop bridge``: the front's connection on the asyncio thread, the core on the bridge's
    trio thread, as in ``ferry serve``. Each frame's jobs cross in one hop; each delivery of
    events is answered in one frame."""

    def __init__(self, batches: Batches, bridge: BatchedBridge) -> None:
        self.batches = batches
        self.bridge = bridge
        self.handles: dict[int, Handle] = {}
        self.rids: dict[Handle, int] = {}
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.gone = asyncio.get_running_loop().create_future()  # resolves when the front disconnects
        bridge.delivered = self.answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is not None:
            transport.close()  # one front only
            return
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.gone.done():
            self.gone.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        for payload in split_frames(self.buffer):
            self.take(*decode_frame(payload))

    def take(self, requests: Requests, cancels: list[int]) -> None:
        """Submit a frame's jobs (one hop to trio for all), cancel those whose clients left."""
        bridge, model = self.bridge, self.batches.route.model.name
        accepted, refused = self.batches.jobs(requests)
        for rid, job in accepted:
            try:
                handle = bridge.submit(model, job)
            except api.ApiError as exc:  # the core is not running
                self.batches.drop(rid)
                refused.append((rid, *refusal(exc)))
                continue
            self.handles[rid] = handle
            self.rids[handle] = rid
        for rid in cancels:
            if self.batches.cancel(rid):
                handle = self.handles.pop(rid)
                del self.rids[handle]
                bridge.cancel(handle)
        self.send(refused)

    def answer(self, batch: list[tuple[Handle, list[Event]]]) -> None:
        """Answer every request that ended in this delivery, in one frame."""
        answers = []
        for handle, _ in batch:
            if not handle.ended or handle not in self.rids:
                continue  # only started, or cancelled
            rid = self.rids.pop(handle)
            del self.handles[rid]
            events, handle.events = handle.events, []
            answer = self.batches.finish(rid, events)
            if answer is not None:
                answers.append(answer)
        self.send(answers)

    def send(self, answers: Answers) -> None:
        if answers and self.transport is not None:
            self.batches.answer_frames += 1
            self.transport.write(encode_answers(answers))


class TrioCore:
    """``--hop none``: the front's connection read and written by a task of the trio core
    itself, jobs handed to the backend directly: no asyncio loop and no bridge, so a frame costs
    one wake-up of one loop. Answers are built by the writer task, after the pool's task that
    delivered the results has moved on to the worker's next call."""

    def __init__(self, batches: Batches, backend: Backend[Any], stream: trio.SocketStream) -> None:
        self.batches = batches
        self.backend = backend
        self.stream = stream
        self.events: dict[int, list[Event]] = {}  # of each job in the core, by request id
        self.tickets: dict[int, Any] = {}
        self.finished: list[tuple[int, list[Event]]] = []
        self.refused: Answers = []
        self.ready = trio.Event()

    async def read_frames(self) -> None:
        """Until the front closes: each frame's jobs submitted, its cancellations carried out."""
        buffer = bytearray()
        while data := await self.stream.receive_some(1 << 16):
            buffer += data
            for payload in split_frames(buffer):
                self.take(*decode_frame(payload))

    def take(self, requests: Requests, cancels: list[int]) -> None:
        accepted, refused = self.batches.jobs(requests)
        self.refused += refused
        for rid, job in accepted:
            self.events[rid] = []
            ticket = self.backend.submit(job, functools.partial(self.on_event, rid))
            if rid in self.events:  # not shed at once
                self.tickets[rid] = ticket
        for rid in cancels:
            if self.batches.cancel(rid) and rid in self.tickets:
                self.backend.cancel(self.tickets.pop(rid))
                del self.events[rid]
        if self.refused:
            self.ready.set()

    def on_event(self, rid: int, event: Event) -> None:
        events = self.events[rid]
        events.append(event)
        if isinstance(event, TERMINAL_EVENTS):
            del self.events[rid]
            self.tickets.pop(rid, None)
            self.finished.append((rid, events))
            self.ready.set()

    async def write_answers(self) -> None:
        """Whatever has finished since the last write goes as one frame."""
        while True:
            await self.ready.wait()
            self.ready = trio.Event()
            finished, self.finished = self.finished, []
            answers, self.refused = self.refused, []
            answers += [answer for rid, events in finished if (answer := self.batches.finish(rid, events))]
            if answers:
                self.batches.answer_frames += 1
                await self.stream.send_all(encode_answers(answers))


def start_front(binary: pathlib.Path, scratch: Scratch) -> tuple[subprocess.Popen, str]:
    """The Rust front, connected to the core's socket; its URL once it listens."""
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: build it with experiments/rust_front/build.sh")
    argv = [str(binary), "--core", scratch.socket, "--keys", scratch.keys]
    argv += ["--max-body", str(scratch.max_body), "--gather-us", str(scratch.gather_us)]
    front = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = front.stdout.readline()  # type: ignore[union-attr]
    if "listening on http://" not in line:
        raise SystemExit(f"the Rust front did not start (exit {front.wait()})")
    return front, line.rsplit(" ", 1)[1].strip()


def set_collector() -> None:
    gc.freeze()  # as ferry serve does once it is up: a collection scans only what requests leave
    gc.set_threshold(*GC_THRESHOLDS)


class Scratch:
    """The key digests' file and the socket's path the front is started with."""

    def __init__(self, directory: str, config: FerryConfig, gather_us: int) -> None:
        self.keys, self.socket = os.path.join(directory, "keys"), os.path.join(directory, "core.sock")
        pathlib.Path(self.keys).write_text("".join(f"{key.digest}\n" for key in config.keys))
        self.max_body = config.server.max_body_bytes
        self.gather_us = gather_us


def announce(front: subprocess.Popen, url: str) -> None:
    print(f"front_batched: --pid {front.pid},{os.getpid()} listening on {url}", flush=True)


async def bridged(args: argparse.Namespace, config: FerryConfig, batches: Batches, scratch: Scratch) -> None:
    """``--hop bridge``, until the front goes away or this process is told to stop (SIGTERM)."""
    bridge = BatchedBridge(open_backend, config.models, config.queue())
    await bridge.start()
    set_collector()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
    core = BridgedCore(batches, bridge)
    try:
        server = await loop.create_unix_server(lambda: core, scratch.socket)
        front, url = await loop.run_in_executor(None, start_front, args.front, scratch)
        announce(front, url)
        try:
            await core.gone  # the front exits with its socket closed, and this with it
        finally:
            front.terminate()
            server.close()
    finally:
        await bridge.stop()


async def in_trio(args: argparse.Namespace, config: FerryConfig, batches: Batches, scratch: Scratch) -> None:
    """``--hop none``, until the front goes away or this process is told to stop (SIGTERM)."""
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, open_backend, config.queue())
        await fleet.open(config.models[0])
        set_collector()
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(scratch.socket)
        listener.listen(1)
        front, url = await trio.to_thread.run_sync(start_front, args.front, scratch)  # connected: backlog
        connection, _ = await listener.accept()
        core = TrioCore(batches, fleet[config.models[0].name], trio.SocketStream(connection))
        announce(front, url)
        try:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                nursery.start_soon(core.write_answers)
                nursery.start_soon(_cancel_on_first, signals, nursery.cancel_scope)
                await core.read_frames()
        finally:
            front.terminate()
        nursery.cancel_scope.cancel()


async def _cancel_on_first(signals: Any, scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()


def main(args: argparse.Namespace) -> None:
    config = parse_config(fixed_only(DEFAULT_TOML), "<front_batched>")  # what http_load's ferry runs
    batches = Batches(FixedRoute(config), [(key.tier, key.tenant) for key in config.keys], args.trace)
    with tempfile.TemporaryDirectory(prefix="ferry-front-") as directory:
        scratch = Scratch(directory, config, args.gather_us)
        try:
            if args.hop == "bridge":
                event_loop.run(bridged(args, config, batches, scratch))  # uvloop, as ferry serve
            else:
                trio.run(in_trio, args, config, batches, scratch)
        except asyncio.CancelledError:
            pass  # SIGTERM: the bridged core stopped
        print(batches.report(), file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", type=pathlib.Path, default=FRONT, help="the Rust front's binary")
    parser.add_argument("--hop", choices=("bridge", "none"), default="bridge",
                        help="bridge: the socket on asyncio, the core behind the bridge (as ferry serve); "
                             "none: the socket read by the trio core itself")
    parser.add_argument("--gather-us", type=int, default=0,
                        help="the front waits this long after a request before it frames what came (a timer, "
                             "to measure what fuller frames save); 0: natural batching alone")
    parser.add_argument("--trace", action="store_true", help="a line on stderr for each frame with requests")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
