"""Faults a chaos scenario injects while its traffic runs: each an async function of the run's
:class:`Run` (the gateway, the Redis server if the row has one, and a :class:`Clock` that
records when the fault struck).

Worker faults that live inside the worker (hangs, stragglers, poison inputs, wrong output
counts, garbage frames, crash loops) are not here: they are the fault flags of the scenario's
worker command line (``workers/faults.py``). What is here acts from outside, as an operator's
bad day or a hostile client would: signals to processes, and sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import socket

from experiments.chaos.ray_nodes import RayNodes
from experiments.chaos.ray_partition import PartitionedNodes
from experiments.chaos.server import Server
from tests.support.redis_server import RedisServer


class Clock:
    """Loop times at which the fault struck (for the recovery figure), and what a fault's own
    watch saw go wrong (``problems``: the row's violations)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.problems: list[str] = []
        self.notes: list[str] = []  # what a watch measured: the row's notes

    def mark(self) -> None:
        self.times.append(asyncio.get_running_loop().time())


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    server: Server
    clock: Clock
    duration: float  # seconds of traffic
    seed: int = 0
    redis: RedisServer | None = None
    ray: RayNodes | PartitionedNodes | None = None


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


async def _pids(server: Server) -> list[int]:
    return await asyncio.to_thread(server.worker_pids)


async def kill_workers(run: Run, every: float) -> None:
    """SIGKILL one worker, picked at random, busy or idle, every ``every`` seconds."""
    draw = random.Random(run.seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + run.duration
    while loop.time() + every < end:
        await asyncio.sleep(every)
        pids = await _pids(run.server)
        if pids and kill(draw.choice(pids)):
            run.clock.mark()


async def kill_idle_fleet(run: Run, at: float) -> None:
    """SIGKILL every worker at once, at a moment the traffic plan keeps quiet (a gap)."""
    await asyncio.sleep(at)
    for pid in await _pids(run.server):
        kill(pid)
    run.clock.mark()


async def lose_node(run: Run, at: float) -> None:
    """Kill the raylet of the Ray node that holds the most workers: its actors die with it, and
    every request with budget left must still be answered by the other node's workers."""
    assert isinstance(run.ray, RayNodes), "a node loss needs a row with ray = True"
    await asyncio.sleep(at)
    await asyncio.to_thread(run.ray.lose, await _placements(run))
    run.clock.mark()


async def _placements(run: Run) -> list[str]:
    models = (await asyncio.to_thread(run.server.get, "/readyz"))[1].get("models", {})
    return [w.get("placement", "") for model in models.values() for w in model.get("workers", [])]


async def partition_node(run: Run, at: float, length: float, settle: float) -> None:
    """Cut the namespace's Ray node off (its link down for ``length`` seconds, then up): its
    workers are lost to the gateway, which must replace them on the other node; within ``settle``
    seconds of the link's return the fleet must be whole again, none of it on the cut node, and
    the gateway's named actors no more than its workers (the cut node's are not counted twice)."""
    assert isinstance(run.ray, PartitionedNodes), "a partition needs a row with ray = 'partition'"
    await asyncio.sleep(at)
    before = await _placements(run)
    run.clock.mark()
    node = await asyncio.to_thread(run.ray.cut, length)
    on_cut = sum(p.endswith(node) for p in before)
    run.clock.notes.append(f"link down {length:.1f} s: {on_cut} of {len(before)} workers on the cut node")
    loop = asyncio.get_running_loop()
    returned = loop.time()
    while True:
        placements = await _placements(run)
        actors = await asyncio.to_thread(run.ray.gateway_actors)
        whole = len(placements) == len(before) and not any(p.endswith(node) for p in placements)
        if whole and actors == len(before):
            run.clock.notes.append(f"{loop.time() - returned:.1f} s after the link returned: "
                                   f"{len(placements)} workers, none on the cut node, "
                                   f"{actors} actors named by the gateway")
            return
        if loop.time() - returned > settle:
            run.clock.problems.append(f"{settle:.0f} s after the link returned: placements {placements}, "
                                      f"{actors} actors named by the gateway for {len(before)} workers")
            return
        await asyncio.sleep(0.25)


async def watch_not_ready(run: Run, after: float, every: float = 0.05) -> None:
    """A fleet that crashes on every call must say so: /readyz stays 503 from ``after`` on."""
    await asyncio.sleep(after)
    loop = asyncio.get_running_loop()
    end = loop.time() + run.duration - after
    while loop.time() < end:
        if await asyncio.to_thread(run.server.ready):
            run.clock.problems.append("/readyz said ready while every worker crashes on its first call")
            return
        await asyncio.sleep(every)


async def terminate_gateway(run: Run, at: float) -> None:
    """SIGTERM the gateway under load: it must drain what it accepted, then exit 0."""
    await asyncio.sleep(at)
    run.server.send_signal(signal.SIGTERM)
    run.clock.mark()


async def kill_gateway(run: Run, at: float) -> None:
    """SIGKILL the gateway under load: no drain, no flush. Every answer a client got must still
    have its usage row (written ahead of the answer's last bytes)."""
    await asyncio.sleep(at)
    run.server.send_signal(signal.SIGKILL)
    run.clock.mark()


async def watch_limits(run: Run, per_minute: dict[str, int], settle: float = 1.0) -> None:
    """After the traffic, a healthy Redis must have kept each limited tier's key within its
    limit: its 200s within a full bucket plus its refill over the run, no charge in a local
    bucket, none refused for a busy store, no refund left unsent. Read once the answers have
    stopped coming (an overloaded run's last answers come late) and the refunds queue is empty,
    or after 30 s."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.sleep(run.duration)
    seen, metrics = -1.0, {}
    while loop.time() < began + run.duration + 30:
        metrics = await asyncio.to_thread(run.server.metrics)
        answered = sum(v for (name, _), v in metrics.items() if name == "ferry_requests_total")
        if answered == seen and metrics.get(("ferry_limiter_refunds_pending", ())) == 0:
            break
        seen = answered
        await asyncio.sleep(settle)
    took = loop.time() - began
    for tier, limit in per_minute.items():
        bound = limit + limit / 60 * took
        admitted = sum(
            value
            for (name, labels), value in metrics.items()
            if name == "ferry_requests_total" and ("tier", tier) in labels and ("status", "200") in labels
        )
        if admitted > bound:
            run.clock.problems.append(f"{admitted:.0f} requests of the {tier} key admitted, "
                                      f"over its bound {bound:.0f}")
        run.clock.notes.append(f"{tier} key: {admitted:.0f} admitted in {took:.1f} s, bound {bound:.0f}")
    for name, want in (("ferry_limiter_fallbacks_total", 0), ("ferry_limiter_busy_total", 0),
                       ("ferry_limiter_refunds_pending", 0), ("ferry_limiter_store_up", 1)):
        got = metrics.get((name, ()))
        if got != want:
            run.clock.problems.append(f"{name} is {got}, not {want}")
    local, pending, late = (metrics.get((f"ferry_limiter_{name}", ()), 0)
                            for name in ("fallbacks_total", "refunds_pending", "late_total"))
    run.clock.notes.append(f"{local:.0f} charged locally, {pending:.0f} keys with refunds left; "
                           f"calls made again after a late reply: {late:.0f}")


async def redis_outage(run: Run, at: float, length: float, freeze: bool) -> None:
    """Stop Redis (or freeze it with SIGSTOP) for ``length`` seconds, then bring it back: the
    limits fail open to each gateway's own buckets, and no request may fail for it."""
    assert run.redis is not None, "a Redis fault needs a row with redis = True"
    await asyncio.sleep(at)
    await asyncio.to_thread(run.redis.freeze if freeze else run.redis.stop)
    run.clock.mark()
    await asyncio.sleep(length)
    await asyncio.to_thread(run.redis.thaw if freeze else run.redis.start)
    run.clock.mark()


async def hold_connections(run: Run, at: float, count: int, hold: float, partial: bytes = b"") -> None:
    """Open ``count`` connections, send ``partial`` (nothing: idle; half a request: a slow
    loris) and keep them open for ``hold`` seconds, while the real traffic goes on."""
    await asyncio.sleep(at)
    run.clock.mark()
    held = []
    for _ in range(count):
        try:
            sock = socket.create_connection((run.server.host, run.server.port), timeout=5)
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
