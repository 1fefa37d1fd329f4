"""Shared test helpers: a fleet of simulated workers whose every call can be inspected."""

from __future__ import annotations

import pytest

from workers.faults import FaultPlan
from workers.simulated import SimulatedWorker, constant


class Fleet:
    """A Spawn for the pool: simulated workers, with a fault plan per slot if asked.

    ``plans[slot]`` applies to the first worker spawned in that slot only; its replacement
    after a restart is healthy, like a GPU whose process crashed once.
    """

    def __init__(self, plans: dict[int, FaultPlan] | None = None, service: float = 0.2) -> None:
        self.plans = dict(plans or {})
        self.service = service
        self.spawned: list[tuple[int, SimulatedWorker]] = []

    def __call__(self, slot: int) -> SimulatedWorker:
        worker = SimulatedWorker(constant(self.service), self.plans.pop(slot, FaultPlan()))
        self.spawned.append((slot, worker))
        return worker

    def calls(self, slot: int | None = None) -> list[list[str]]:
        """Inputs of every call, in order per worker, of one slot or of all."""
        return [call for s, worker in self.spawned if slot in (None, s) for call in worker.calls]

    def inputs_seen(self) -> list[str]:
        return [text for call in self.calls() for text in call]


@pytest.fixture
def fleet_factory():
    return Fleet
