"""The backends of the running core, one per model version, opened and closed while it runs.

A rollout without downtime: a new version warms up before it takes traffic, and a retired one
finishes what it has before its workers stop. Each version is a task of the fleet's nursery
that holds its backend open until told to close::

    open(model)  ──> task: async with launch(model) ──started──> open() returns: it takes jobs
    close(name)  ──> leaves the table ──> stop ──> context exits: workers stop ──> close() returns

``open`` raises what kept a version from opening and leaves the rest of the core running; a
backend that fails after it opened fails the whole core. Which version takes which request is
the gateway's (docs/architecture.md, "The fleet and the launch"). Trio thread only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from batcher.core.backend import Backend
from batcher.core.config import ModelConfig, QueueConfig

Launch = Callable[[ModelConfig, QueueConfig], AbstractAsyncContextManager[Backend[Any]]]
"""Opens one model version's backend (its workers, its batching) with the tiers' queue settings."""


@dataclasses.dataclass(slots=True)
class _Version:
    backend: Backend[Any]
    stop: trio.Event
    closed: trio.Event


class Fleet:
    """The open versions by name; ``fleet[name]`` is the backend that takes its jobs."""

    def __init__(self, nursery: trio.Nursery, launch: Launch, queue: QueueConfig) -> None:
        self._nursery = nursery
        self._launch = launch
        self.queue = queue
        self._versions: dict[str, _Version] = {}
        self._opening: set[str] = set()

    def __getitem__(self, name: str) -> Backend[Any]:
        return self._versions[name].backend

    def __contains__(self, name: str) -> bool:
        return name in self._versions

    def items(self) -> Iterator[tuple[str, Backend[Any]]]:
        return ((name, version.backend) for name, version in self._versions.items())

    async def open(self, model: ModelConfig) -> None:
        """Open a version and return once it takes jobs; raises what kept it from opening."""
        if model.name in self._versions or model.name in self._opening:
            raise ValueError(f"model {model.name!r} is already open")
        self._opening.add(model.name)
        try:
            await self._nursery.start(self._run, model)
        finally:
            self._opening.discard(model.name)

    async def close(self, name: str) -> None:
        """Take a version out of the table now, stop its backend, return once its workers are
        gone. Jobs it still holds get no further event: close what has drained."""
        version = self._versions.pop(name)
        version.stop.set()
        await version.closed.wait()

    def retune(self, queue: QueueConfig) -> None:
        """New wait budgets for the same tiers: every open backend judges by them from now on,
        and versions opened later start with them."""
        self.queue = queue
        for version in self._versions.values():
            version.backend.retune(queue)

    async def _run(self, model: ModelConfig, *, task_status: trio.TaskStatus[None]) -> None:
        closed = trio.Event()
        try:
            async with self._launch(model, self.queue) as backend:
                version = self._versions[model.name] = _Version(backend, trio.Event(), closed)
                task_status.started()
                await version.stop.wait()
        finally:
            closed.set()
