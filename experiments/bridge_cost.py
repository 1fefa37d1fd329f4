"""What the asyncio <-> trio bridge costs per request, with nothing else in the way.

The trio side is an instant backend (each job is answered the moment it is submitted, with the
``Started``, ``Delta`` and ``Finished`` events a fixed-mode batch gives), so all that is measured
is ``gateway.bridge``: the hop to trio, the job's bookkeeping there, and the hop back with its
events. Two shapes:

- one at a time: a request's round trip (two thread hops), wall time;
- bursts of 50 (a batch's worth): process CPU time (both threads) per request, and how many
  requests share each hop.

    .venv/bin/python experiments/bridge_cost.py            # uvloop, then plain asyncio
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from batcher.core.backend import Delta, Finished, Job, Sampling, Started, Usage
from batcher.core.config import QueueConfig
from batcher.fixed.config import FixedModelConfig
from gateway.bridge import Bridge


class InstantBackend:
    """The Backend protocol, answering every job at once (its prompt reversed)."""

    def submit(self, job: Job, on_event) -> None:
        on_event(Started(0.0))
        on_event(Delta(job.prompt[::-1], len(job.prompt)))
        on_event(Finished("end_turn", Usage(len(job.prompt_tokens), 0, len(job.prompt))))

    def cancel(self, ticket) -> None:
        pass


@contextlib.asynccontextmanager
async def instant(model, queue):
    yield InstantBackend()


JOB = Job("x", b"x", Sampling(1), "paid")


async def answered(bridge: Bridge) -> None:
    handle = bridge.submit("m", JOB)
    while not handle.ended:
        await handle.wait()


async def measure(sequential: int, bursts: int, burst: int = 50) -> dict[str, float]:
    bridge = Bridge(instant, [FixedModelConfig(name="m", worker=("echo",))], QueueConfig())
    await bridge.start()
    try:
        started = time.perf_counter()
        for _index in range(sequential):
            await answered(bridge)
        round_trip = (time.perf_counter() - started) / sequential
        hops_before = bridge.hops_to_trio + bridge.hops_to_asyncio
        cpu, wall = time.process_time(), time.perf_counter()
        for _index in range(bursts):
            await asyncio.gather(*(answered(bridge) for _ in range(burst)))
        count = bursts * burst
        return {
            "round trip µs": 1e6 * round_trip,
            "burst CPU µs/request": 1e6 * (time.process_time() - cpu) / count,
            "burst wall µs/request": 1e6 * (time.perf_counter() - wall) / count,
            "requests per hop": 2 * count / (bridge.hops_to_trio + bridge.hops_to_asyncio - hops_before),
        }
    finally:
        await bridge.stop()


def main() -> None:
    loops = []
    try:
        import uvloop

        loops.append(("uvloop", uvloop.run))
    except ImportError:
        pass
    loops.append(("asyncio", asyncio.run))
    for name, run in loops:
        figures = run(measure(sequential=5000, bursts=2000))
        print(f"{name:8}", "  ".join(f"{key}: {value:.1f}" for key, value in figures.items()))


if __name__ == "__main__":
    main()
