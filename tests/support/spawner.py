"""A Spawn for the fixed pool made of inspectable simulated workers, with a fault plan per slot."""

from __future__ import annotations

from batcher.sim.fixed.workers import SimulatedWorker, constant
from workers.faults import FaultPlan


class Spawner:
    """A Spawn for the pool: simulated workers, with a fault plan per slot if asked.

    ``plans[slot]`` applies to the first worker spawned in that slot only; its replacement
    after a restart is healthy, like a GPU whose process crashed once. ``every`` applies to
    every worker spawned while it is set (a broken build; set it to None to deploy the fix).
    """

    def __init__(
        self, plans: dict[int, FaultPlan] | None = None, service: float = 0.2, every: FaultPlan | None = None,
        start_s: float = 0.0,
    ) -> None:
        self.plans = dict(plans or {})
        self.start_s = start_s  # each worker's time from spawn to ready
        self.service = service
        self.every = every
        self.spawned: list[tuple[int, SimulatedWorker]] = []

    def __call__(self, slot: int) -> SimulatedWorker:
        plan = self.plans.pop(slot, self.every or FaultPlan())
        worker = SimulatedWorker(constant(self.service), plan, start_s=self.start_s)
        self.spawned.append((slot, worker))
        return worker

    def worker(self, slot: int) -> SimulatedWorker:
        """The worker spawned last in ``slot``."""
        return [worker for s, worker in self.spawned if s == slot][-1]

    def calls(self, slot: int | None = None) -> list[list[str]]:
        """Inputs of every call, in order per worker, of one slot or of all."""
        return [call for s, worker in self.spawned if slot in (None, s) for call in worker.calls]

    def inputs_seen(self) -> list[str]:
        return [text for call in self.calls() for text in call]
