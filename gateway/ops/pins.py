"""Requests in progress per model version, counted by the request handlers and read by the
rollout: a version is closed only once no request that resolved to it is still running."""

from __future__ import annotations

import asyncio
import collections


class Pins:
    """Requests in progress per version, counted by the handlers: a version has drained when
    its count is back to zero."""

    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def hold(self, name: str) -> None:
        """A request starts on this version; it calls :meth:`release` when it ends, whatever
        happens (a ``try``/``finally``: a generator-based context manager costs several calls
        more on every request)."""
        self._held[name] += 1

    def release(self, name: str) -> None:
        self._held[name] -= 1
        if not self._held[name]:
            del self._held[name]
            for waiter in self._waiters.pop(name, []):
                if not waiter.done():
                    waiter.set_result(None)

    def count(self, name: str) -> int:
        return self._held[name]

    async def released(self, name: str) -> None:
        """Return once no request holds this version."""
        if self._held[name]:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(name, []).append(waiter)
            await waiter
