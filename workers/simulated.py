"""A worker that lives in the gateway's trio run: a ``trio.sleep`` of the service time.

It honours the same :class:`~workers.faults.FaultPlan` as the real worker process, through the
same :class:`~workers.faults.FaultInjector`, and answers with the same protocol messages, so
the production pool supervises it unchanged. Under ``trio.testing.MockClock`` its sleeps cost
no real time: tests and experiments run the real scheduler over hours of virtual traffic.

A crash happens halfway through the call (the worker dies mid-batch); a hang never returns.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from workers.faults import Fault, FaultInjector, FaultPlan
from workers.models import mirror
from workers.protocol import Error, Result, RunBatch, WorkerLost

ServiceTime = Callable[[int], float]
"""Seconds one call of a given batch size takes."""


def constant(seconds: float) -> ServiceTime:
    """The reference GPU of seed 000 §7.1: the same cost at any batch size."""
    return lambda size: seconds


class SimulatedWorker:
    """Answers each call after ``service_time(len(inputs))``; outputs are the inputs reversed."""

    pid = None

    def __init__(self, service_time: ServiceTime = constant(0.2), plan: FaultPlan = FaultPlan()) -> None:
        self.service_time = service_time
        self.injector = FaultInjector(plan)
        self.calls: list[list[str]] = []
        """The inputs of every call this worker received, in order."""
        self.stopped = False

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def call(self, request: RunBatch) -> Result | Error:
        if self.stopped:
            raise WorkerLost("simulated worker was stopped")
        self.calls.append(list(request.inputs))
        fault = self.injector.next_call(request.inputs)
        seconds = self.service_time(len(request.inputs)) * self.injector.plan.slow_factor
        if fault is Fault.CRASH:
            await trio.sleep(seconds / 2)
            raise WorkerLost(f"simulated crash on call {self.injector.calls}")
        if fault is Fault.HANG:
            await trio.sleep_forever()
        await trio.sleep(seconds)
        if fault is Fault.POISON:
            return Error(request.id, self.injector.poison_message(request.inputs))
        outputs = mirror(request.inputs)
        if fault is Fault.WRONG_COUNT:
            outputs.pop()
        return Result(request.id, outputs)

    async def stop(self) -> None:
        self.stopped = True
