"""A test's side of the production fixed-mode batcher: opening it over simulated workers with the
timings the virtual-time tests assert (``running``), and submitting inputs and collecting how
each ended (``Outcomes`` through the synchronous API, ``submit_all`` through ``answer``)."""

from __future__ import annotations

import contextlib

import trio

from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import RequestFailed
from batcher.fixed.batcher import open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.request import Request
from tests.support.spawner import Spawner

SERVICE, T, HANG = 0.2, 0.15, 1.0
"""A simulated worker's call time, the flush timeout, the hang timeout (seconds, virtual)."""


@contextlib.asynccontextmanager
async def running(fleet: Spawner, workers: int = 2, max_attempts: int = 3):
    """The batcher over ``fleet``: batches of 50 or after T, HANG, a 30 s queue timeout."""
    pool = PoolConfig(workers=workers, hang_timeout=HANG, max_attempts=max_attempts)
    async with open_batcher(fleet, pool, SizeOrTimeout(50, T), QueueConfig(queue_timeout=30.0)) as batcher:
        yield batcher


class Outcomes:
    """Enqueue through the synchronous API and wait until every request has ended."""

    def __init__(self, batcher) -> None:
        self.batcher = batcher
        self.ended: list[Request] = []
        self._changed = trio.Event()

    def add(self, texts, tier="paid", timeout=None, tenant="") -> list[Request]:
        requests = [self.batcher.request(text, tier, timeout, on_done=self._on_done, tenant=tenant)
                    for text in texts]
        for request in requests:
            self.batcher.enqueue(request)
        return requests

    def _on_done(self, request: Request) -> None:
        self.ended.append(request)
        self._changed.set()

    async def wait(self, count: int) -> None:
        while len(self.ended) < count:
            self._changed = trio.Event()
            await self._changed.wait()


def texts(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


async def submit_all(batcher, inputs: list[str]) -> dict[str, str | Exception]:
    """Ask for every input at once (paid); each one's answer, or the RequestFailed it got."""
    results: dict[str, str | Exception] = {}

    async def one(text: str) -> None:
        try:
            results[text] = await batcher.answer(text, "paid")
        except RequestFailed as exc:
            results[text] = exc

    async with trio.open_nursery() as nursery:
        for text in inputs:
            nursery.start_soon(one, text)
    return results
