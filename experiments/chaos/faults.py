"""Faults a chaos scenario injects while its traffic runs: each an async function of the running
:class:`~experiments.chaos.server.Server` and a :class:`Clock` that records when it struck.

Worker faults that live inside the worker (hangs, stragglers, poison inputs, wrong output
counts, garbage frames, crash loops) are not here: they are the fault flags of the scenario's
worker command line (``workers/faults.py``). What is here acts from outside, as an operator's
bad day or a hostile client would: signals to processes, and sockets.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket

from experiments.chaos.server import Server


class Clock:
    """Loop times at which the fault struck (for the recovery figure), and what a fault's own
    watch saw go wrong (``problems``: the row's violations)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.problems: list[str] = []

    def mark(self) -> None:
        self.times.append(asyncio.get_running_loop().time())


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


async def _pids(server: Server) -> list[int]:
    return await asyncio.to_thread(server.worker_pids)


async def kill_workers(server: Server, clock: Clock, every: float, until: float, seed: int = 0) -> None:
    """SIGKILL one worker, picked at random, busy or idle, every ``every`` seconds."""
    draw = random.Random(seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + until
    while loop.time() + every < end:
        await asyncio.sleep(every)
        pids = await _pids(server)
        if pids and _kill(draw.choice(pids)):
            clock.mark()


async def kill_idle_fleet(server: Server, clock: Clock, at: float) -> None:
    """SIGKILL every worker at once, at a moment the traffic plan keeps quiet (a gap)."""
    await asyncio.sleep(at)
    for pid in await _pids(server):
        _kill(pid)
    clock.mark()


async def watch_not_ready(server: Server, clock: Clock, until: float, after: float, every: float = 0.05) -> None:
    """A fleet that crashes on every call must say so: /readyz stays 503 from ``after`` on."""
    await asyncio.sleep(after)
    loop = asyncio.get_running_loop()
    end = loop.time() + until
    while loop.time() < end:
        if await asyncio.to_thread(server.ready):
            clock.problems.append("/readyz said ready while every worker crashes on its first call")
            return
        await asyncio.sleep(every)


async def terminate_gateway(server: Server, clock: Clock, at: float) -> None:
    """SIGTERM the gateway under load: it must drain what it accepted, then exit 0."""
    await asyncio.sleep(at)
    server.send_signal(signal.SIGTERM)
    clock.mark()


async def hold_connections(server: Server, clock: Clock, at: float, count: int, hold: float,
                           partial: bytes = b"") -> None:
    """Open ``count`` connections, send ``partial`` (nothing: idle; half a request: a slow
    loris) and keep them open for ``hold`` seconds, while the real traffic goes on."""
    await asyncio.sleep(at)
    clock.mark()
    held = []
    for _ in range(count):
        try:
            sock = socket.create_connection((server.host, server.port), timeout=5)
        except OSError:
            break  # the gateway refuses more: that is a documented answer, not this fault's failure
        sock.setblocking(False)
        if partial:
            try:
                sock.send(partial)
            except OSError:
                pass
        held.append(sock)
    await asyncio.sleep(hold)
    for sock in held:
        sock.close()
