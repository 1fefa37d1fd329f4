"""A worker that lives in the gateway's trio run: a ``trio.sleep`` of the service time.

It honours the same :class:`~workers.faults.FaultPlan` as the real worker process, through the
same :class:`~workers.faults.FaultInjector`, and answers with the same protocol messages, so
the production pool supervises it unchanged. Under ``trio.testing.MockClock`` its sleeps cost
no real time: tests and experiments run the real scheduler over hours of virtual traffic.

A crash happens halfway through the call (the worker dies mid-batch); a hang never returns.
:meth:`SimulatedWorker.kill` is a SIGKILL from outside: the worker exits at once, whatever it
was doing, and a call sent afterwards finds it gone (``NotDelivered``), as a closed pipe would.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import trio

from workers.faults import Fault, FaultInjector, FaultPlan
from workers.models import mirror
from workers.protocol import Error, NotDelivered, ProtocolError, Result, RunBatch, WorkerLost

ServiceTime = Callable[[int], float]
"""Seconds one call of a given batch size takes."""


def constant(seconds: float) -> ServiceTime:
    """The reference GPU of the fixed-batch contract: the same cost at any batch size."""
    return lambda size: seconds


def linear(fixed: float, per_input: float = 0.0, jitter: float = 0.0, seed: int = 0) -> ServiceTime:
    """``fixed + per_input x size`` seconds, times a uniform factor in ``[1 - jitter, 1 + jitter]``.

    A real accelerator's call has a fixed part (reading the weights, launching kernels) and a
    part that grows with the batch; jitter stands for everything else. Each call of the returned
    model draws its own factor from a generator seeded with ``seed``.
    """
    if fixed < 0 or per_input < 0 or fixed + per_input <= 0:
        raise ValueError(
            f"service time: expected fixed, per_input >= 0 and not both 0, got {fixed}, {per_input}"
        )
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter: expected a fraction in [0, 1), got {jitter}")
    if jitter == 0.0:
        return lambda size: fixed + per_input * size
    draw = random.Random(seed).uniform
    return lambda size: (fixed + per_input * size) * draw(1.0 - jitter, 1.0 + jitter)


class SimulatedWorker:
    """Answers each call after ``service_time(len(inputs))``; outputs are the inputs reversed.

    ``record=False`` keeps no copy of the inputs (a simulation of millions of requests).
    """

    pid: int | None = None

    def __init__(
        self, service_time: ServiceTime = constant(0.2), plan: FaultPlan = FaultPlan(), record: bool = True
    ) -> None:
        self.service_time = service_time
        self.injector = FaultInjector(plan)
        self.calls: list[list[str]] = []
        """The inputs of every call this worker received, in order (if recording)."""
        self.record = record
        self.stopped = False
        self._exited = trio.Event()
        self._life = trio.CancelScope()  # the current call's; kill() cancels it

    placement = "local"

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def call(self, request: RunBatch) -> Result | Error:
        if self._exited.is_set():
            raise NotDelivered("simulated worker had exited")
        if self.record:
            self.calls.append(list(request.inputs))
        fault = self.injector.next_call(request.inputs)
        seconds = self.service_time(len(request.inputs)) * self.injector.plan.slow_factor
        with trio.CancelScope() as life:
            self._life = life
            if fault is Fault.CRASH:
                await trio.sleep(seconds / 2)
                self._exited.set()
                raise WorkerLost(f"simulated crash on call {self.injector.calls}")
            if fault is Fault.HANG:
                await trio.sleep_forever()
            await trio.sleep(seconds)
        if life.cancelled_caught:
            raise WorkerLost(f"simulated worker killed during call {self.injector.calls}")
        if fault is Fault.POISON:
            return Error(request.id, f"ValueError: {self.injector.poison_message(request.inputs)}")
        outputs = mirror(request.inputs)
        if fault is Fault.WRONG_COUNT:
            outputs.pop()
        if fault is Fault.GARBAGE:
            raise ProtocolError("frame is not msgpack (simulated garbage)")
        return Result(request.id, outputs)

    def kill(self) -> None:
        """Exit now, like a SIGKILL: a call in progress ends as a crash."""
        self._exited.set()
        self._life.cancel()

    async def wait_exit(self) -> None:
        await self._exited.wait()

    async def stop(self, grace: float = 0.0) -> None:
        self.stopped = True
        self._exited.set()
