"""The scaler's chaos rows: their model tables and faults (docs/operations.md, "Scaling").

``scale-down-under-load``: a fixed model at ``min_workers = 1, max_workers = 4`` that a burst
grows and the traffic after it, still flowing, shrinks: workers leave while requests arrive, and
the checks say none was lost or answered twice. ``kill-during-scale-up``: the same model, and
each worker the scaler starts for the burst is SIGKILLed while it is still starting.
``pool-eviction``: the model shares a one-slot pool with another version; in a quiet gap of
its traffic the other version gets requests (the model, idle, is evicted), and when its
traffic resumes its requests wait for the slot while the other version is evicted in turn.
Each fault watches ``/readyz`` and notes what the fleet did; a row whose fleet did not do what
the row is about (scale down under load, start a worker to kill, evict) is a violation."""

from __future__ import annotations

import asyncio

from experiments.chaos.faults import Run, kill
from experiments.chaos.server import Server
from experiments.chaos.traffic import Shot, send_one

OTHER = "other@1"
WATCH_EVERY = 0.05  # seconds between two looks at /readyz


def elastic_model(fixed_model, worker: list[str], workers: int) -> str:
    """``fixed_model``'s table, scaled by the scaler between 1 and ``workers`` workers, down
    after one second of spare capacity."""
    scaler = f"min_workers = 1\nmax_workers = {workers}\nscale_down_after_s = 1\n"
    return fixed_model(worker, workers) + scaler


def pooled_model(fixed_model, worker: list[str], workers: int) -> str:
    """``fixed_model``'s table in a one-slot pool shared with :data:`OTHER`, a version of the
    same workers."""
    argv = ", ".join(f'"{arg}"' for arg in worker)
    return f"""
[[pools]]
name = "rare"
slots = 1

[[models]]
name = "{OTHER}"
worker = [{argv}]
pool = "rare"
""" + fixed_model(worker, workers).replace(f"workers = {workers}\n", 'pool = "rare"\n', 1)


def _models(server: Server) -> dict:
    return server.get("/readyz")[1].get("models", {})


async def _look(server: Server) -> dict:
    return await asyncio.to_thread(_models, server)


async def watch_scale_down(run: Run) -> None:
    """Note the serving sizes the fleet went through while traffic flowed; a violation if it
    never grew, or never shrank before the traffic ended."""
    loop = asyncio.get_running_loop()
    end, sizes = loop.time() + run.duration, []
    while loop.time() < end:
        workers = [w for model in (await _look(run.server)).values() for w in model["workers"]]
        size = sum(w["state"] != "draining" for w in workers)
        if not sizes or sizes[-1] != size:
            sizes.append(size)
        if any(w["state"] == "draining" for w in workers) and not run.clock.times:
            run.clock.mark()  # the first worker seen leaving under load
        await asyncio.sleep(WATCH_EVERY)
    run.clock.notes.append(f"serving workers, as they changed: {' -> '.join(map(str, sizes))}")
    peak = max(sizes, default=0)
    if peak < 2 or peak not in sizes[:-1] or sizes[-1] >= peak:
        run.clock.problems.append(f"the fleet did not grow and shrink under load: {sizes}")


async def kill_starting(run: Run, count: int = 2) -> None:
    """SIGKILL the first ``count`` workers seen starting (with a pid) after the first has
    served: the scaler's new workers, killed before they are ready."""
    loop = asyncio.get_running_loop()
    end, killed, seen = loop.time() + run.duration, [], set()
    seen.update(w["pid"] for model in (await _look(run.server)).values() for w in model["workers"])
    while loop.time() < end and len(killed) < count:
        for model in (await _look(run.server)).values():
            for worker in model["workers"]:
                pid = worker["pid"]
                if worker["state"] == "starting" and pid and pid not in seen and kill(pid):
                    run.clock.mark()
                    killed.append(pid)
                seen.add(pid)
        await asyncio.sleep(0.01)
    run.clock.notes.append(f"workers killed while starting: {len(killed)}")
    if not killed:
        run.clock.problems.append("no worker was seen starting: the fleet never scaled up")


async def evict_in_the_gap(run: Run, key: str, at: float) -> list[Shot]:
    """At ``at`` seconds (in the traffic's quiet gap), ask :data:`OTHER` until it is answered
    (it evicts the idle model); then watch for OTHER's own eviction when the model's traffic
    resumes. OTHER's requests are judged with the traffic (returned)."""
    await asyncio.sleep(at)
    run.clock.mark()
    asked = []
    loop = asyncio.get_running_loop()
    for index in range(10):
        shot = Shot(200_000 + index, "paid", False, f"other {index}", loop.time())
        asked.append(await send_one(run.server.url, key, OTHER, shot))
        if shot.status == 200:
            break
    run.clock.notes.append(f"{OTHER}'s statuses while it took the slot: {[shot.status for shot in asked]}")
    await _watch_eviction(run, run.duration - at)
    return asked


async def _watch_eviction(run: Run, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        other = (await _look(run.server)).get(OTHER, {})
        if "(evicted)" in other.get("scaling", ""):
            run.clock.notes.append(f"{OTHER}: {other['scaling']}")
            return
        await asyncio.sleep(WATCH_EVERY)
    run.clock.problems.append(f"{OTHER} was never evicted for the model's resumed traffic")
