"""What the asyncio <-> trio bridge costs per request, with nothing else in the way.

The trio side is an instant core (each request is answered the moment it is enqueued), so all
that is measured is ``gateway.bridge``: the hop to trio, the request's bookkeeping there, and
the hop back. Two shapes:

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

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from batcher.types import Request, State  # noqa: E402
from gateway.bridge import Bridge  # noqa: E402


class InstantBatcher:
    """The batcher's synchronous API, answering every request at once (input reversed)."""

    def __init__(self) -> None:
        self.ids = 0

    def request(self, input: str, tier=None, timeout=None, on_done=lambda r: None) -> Request:
        self.ids += 1
        now = trio.current_time()
        return Request(self.ids, input, 0, now, now + 30, on_done)

    def enqueue(self, request: Request) -> None:
        request.state = State.DISPATCHED
        request.finish(request.input[::-1], trio.current_time())

    def cancel(self, request: Request) -> None:
        request.cancel(trio.current_time())


@contextlib.asynccontextmanager
async def instant_core():
    yield {"m": InstantBatcher()}


async def measure(sequential: int, bursts: int, burst: int = 50) -> dict[str, float]:
    bridge = Bridge(instant_core)
    await bridge.start()
    try:
        started = time.perf_counter()
        for index in range(sequential):
            await bridge.submit("m", "x").future
        round_trip = (time.perf_counter() - started) / sequential
        hops_before = bridge.hops_to_trio + bridge.hops_to_asyncio
        cpu, wall = time.process_time(), time.perf_counter()
        for index in range(bursts):
            await asyncio.gather(*(bridge.submit("m", "x").future for _ in range(burst)))
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
