"""The core's side of T6: ferry's trio core fed whole batches by a compiled front.

``experiments/rust_front`` (Rust, hyper) accepts HTTP, checks the key and the body's size, and
sends the accepted requests over one Unix socket in frames: whatever arrived while its previous
frame was being written. This process runs what ``experiments/front_cpu.py`` runs behind
aiohttp (the same ``Bridge``, ``open_backend``, 8 reference workers of the embedded default's
fixed model, admission and tier queues, the collector set as ``ferry serve`` sets it) and
:class:`~experiments.front_cpu.FixedRoute`'s per-request steps (the Anthropic codec's parse, the
template, the tokens, the ``Job``; the events into an ``Answer``; the JSON body), but shares
what a batch can share:

- a frame's jobs are all submitted in one pass of the asyncio loop, so they cross to the trio
  thread in one hop (the bridge gathers the submits of one loop iteration);
- no asyncio task or future per request: the bridge's delivery of a trio wake-up's events is
  where the finished requests are answered, as one answer frame per delivery.

Framing (both ways a 4-byte little-endian length, then msgpack): to the core
``[[[id, key index, body], ...], [cancelled id, ...]]``, to the front ``[[id, status, body], ...]``.
The key index is the line of the key's digest in the file the front was started with, in the
order of the config's ``[[keys]]``; the core maps it to the key's tier and tenant.

Kept from ferry: admission and its 529s, the tiers' queues and wait budgets, the workers' retries;
a client that goes away before its answer cancels its job (the front sends its id). Left out, as
in ``front_cpu.py``: per-key limits, the usage ledger and journal, metrics, request ids, the
access log, the connection guard's deadlines, streaming.

    experiments/rust_front/build.sh                # once (experiments/docs/fixed-throughput.md, T6)
    .venv/bin/python -m experiments.front_batched  # prints the URL and the pids to measure
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pathlib
import struct
import subprocess
import tempfile
from collections.abc import Callable

import msgspec

from experiments.front_cpu import FixedRoute, refusal
from experiments.http_load import fixed_only
from gateway.bridge import Bridge, Handle, open_backend
from gateway.config import parse_config
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


class BatchedBridge(Bridge):
    """The bridge, telling :attr:`delivered` after each delivery of events (a private hook:
    an experiment's, so that no task or future waits on each request)."""

    delivered: Callable[[list[tuple[Handle, list]]], None] | None = None

    def _deliver(self, batch: list[tuple[Handle, list]]) -> None:
        super()._deliver(batch)
        if self.delivered is not None:
            self.delivered(batch)


class BatchedCore(asyncio.Protocol):
    """The front's connection: each request frame's jobs submitted together, each delivery's
    finished requests answered together."""

    def __init__(self, route: FixedRoute, bridge: BatchedBridge, principals: list[tuple[str, str]]) -> None:
        self.route = route
        self.bridge = bridge
        self.principals = principals  # key index -> (tier, tenant)
        self.pending: dict[Handle, tuple[int, Messages, Answer]] = {}
        self.by_id: dict[int, Handle] = {}
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
        route, bridge, model = self.route, self.bridge, self.route.model.name
        refused = []
        for rid, key, body in requests:
            tier, tenant = self.principals[key]
            try:
                codec, job = route.job(body, tier, tenant)
                handle = bridge.submit(model, job)
            except api.ApiError as exc:
                refused.append((rid, *refusal(exc)))
                continue
            self.pending[handle] = (rid, codec, route.answer(job))
            self.by_id[rid] = handle
        for rid in cancels:
            if rid in self.by_id:  # else answered already
                handle = self.by_id.pop(rid)
                del self.pending[handle]
                bridge.cancel(handle)
        self.send(refused)

    def answer(self, batch: list[tuple[Handle, list]]) -> None:
        """Answer every request that ended in this delivery, in one frame."""
        answers = []
        for handle, _ in batch:
            if not handle.ended or handle not in self.pending:
                continue  # only started, or cancelled
            rid, codec, reply = self.pending.pop(handle)
            del self.by_id[rid]
            events, handle.events = handle.events, []
            reply.push(events)
            try:
                answers.append((rid, 200, self.route.body(codec, handle.job, reply)))
            except api.ApiError as exc:
                answers.append((rid, *refusal(exc)))
        self.send(answers)

    def send(self, answers: Answers) -> None:
        if answers and self.transport is not None:
            self.transport.write(encode_answers(answers))


def start_front(
    binary: pathlib.Path, socket_path: str, keys_path: str, max_body: int
) -> tuple[subprocess.Popen, str]:
    """The Rust front, connected to ``socket_path``; its URL once it listens."""
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: build it with experiments/rust_front/build.sh")
    argv = [str(binary), "--core", socket_path, "--keys", keys_path, "--max-body", str(max_body)]
    front = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = front.stdout.readline()  # type: ignore[union-attr]
    if "listening on http://" not in line:
        raise SystemExit(f"the Rust front did not start (exit {front.wait()})")
    return front, line.rsplit(" ", 1)[1].strip()


async def main(args: argparse.Namespace) -> None:
    config = parse_config(fixed_only(DEFAULT_TOML), "<front_batched>")  # what http_load's ferry runs
    bridge = BatchedBridge(open_backend, config.models, config.queue())
    await bridge.start()
    gc.freeze()  # as ferry serve does once it is up
    gc.set_threshold(*GC_THRESHOLDS)
    loop = asyncio.get_running_loop()
    core = BatchedCore(FixedRoute(config), bridge, [(key.tier, key.tenant) for key in config.keys])
    try:
        with tempfile.TemporaryDirectory(prefix="ferry-front-") as scratch:
            keys_path, socket_path = os.path.join(scratch, "keys"), os.path.join(scratch, "core.sock")
            pathlib.Path(keys_path).write_text("".join(f"{key.digest}\n" for key in config.keys))
            server = await loop.create_unix_server(lambda: core, socket_path)
            front, url = await loop.run_in_executor(
                None, start_front, args.front, socket_path, keys_path, config.server.max_body_bytes
            )
            print(f"front_batched: --pid {front.pid},{os.getpid()} listening on {url}", flush=True)
            try:
                await core.gone  # the front exits with its socket closed, and this with it
            finally:
                front.terminate()
                server.close()
    finally:
        await bridge.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", type=pathlib.Path, default=FRONT, help="the Rust front's binary")
    return parser.parse_args(argv)


if __name__ == "__main__":
    event_loop.run(main(parse_args()))  # uvloop, as ferry serve
