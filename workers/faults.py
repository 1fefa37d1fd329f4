"""Fault plans: workers that crash, hang, slow down or choke on one bad input, on demand.

A plan is data (flags on the worker's command line, or fields in a simulation); a
:class:`FaultInjector` turns it into one decision per call, the same in virtual time and in a
real process. Calls count from 1 in each process. The random faults draw from ``--seed`` and the
process's *instance* (its slot and start number, passed in :data:`INSTANCE_ENV`), so each process
has its own schedule and a rerun repeats every one; a replacement that replayed its
predecessor's schedule would turn a 5 % crash rate into a crash loop (docs/workers.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import random
from collections.abc import Mapping

INSTANCE_ENV = "FERRY_WORKER_INSTANCE"
"""Environment variable naming a worker process among its pool's: ``"SLOT:START"``."""


class Fault(enum.Enum):
    """What goes wrong with one call."""

    CRASH = "crash"  # the process exits (os._exit) mid-call
    HANG = "hang"  # the call never returns
    POISON = "poison"  # the model raises: one input contains the poison marker
    WRONG_COUNT = "wrong_count"  # one output fewer than inputs
    GARBAGE = "garbage"  # the answer is a frame that is not msgpack: a protocol fault


@dataclasses.dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which faults a worker injects. The default plan injects none."""

    crash_on_call: int | None = None
    crash_prob: float = 0.0
    hang_on_call: int | None = None
    hang_prob: float = 0.0
    slow_factor: float = 1.0
    poison: str | None = None
    wrong_count_on_call: int | None = None
    garbage_on_call: int | None = None
    chatter: bool = False
    only_slot: int | None = None  # inject faults only in the pool's worker of this slot
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("crash_prob", "hang_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"fault plan {name}: expected 0..1, got {value}")
        if self.slow_factor <= 0:
            raise ValueError(f"fault plan slow_factor: expected > 0, got {self.slow_factor}")
        for name in ("crash_on_call", "hang_on_call", "wrong_count_on_call", "garbage_on_call"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"fault plan {name}: calls count from 1, got {value}")
        if self.poison == "":
            raise ValueError("fault plan poison: the marker must not be empty")
        if self.only_slot is not None and self.only_slot < 0:
            raise ValueError(f"fault plan only_slot: expected a slot >= 0, got {self.only_slot}")

    def argv(self) -> list[str]:
        """The worker flags that reproduce this plan (the inverse of :func:`plan_from_args`)."""
        args = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            flag = "--" + field.name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`FaultPlan` field to a worker's argument parser."""
    group = parser.add_argument_group("fault injection")
    group.add_argument("--crash-on-call", type=int, metavar="K", help="exit during call K")
    group.add_argument(
        "--crash-prob", type=float, default=0.0, metavar="P", help="exit on a call with probability P"
    )
    group.add_argument("--hang-on-call", type=int, metavar="K", help="never return from call K")
    group.add_argument(
        "--hang-prob", type=float, default=0.0, metavar="P", help="hang on a call with probability P"
    )
    group.add_argument(
        "--slow-factor", type=float, default=1.0, metavar="F", help="every call takes F times as long"
    )
    group.add_argument("--poison", metavar="MARKER", help="fail any batch with an input containing MARKER")
    group.add_argument(
        "--wrong-count-on-call", type=int, metavar="K", help="return one output too few on call K"
    )
    group.add_argument(
        "--garbage-on-call", type=int, metavar="K", help="answer call K with a frame that is not msgpack"
    )
    group.add_argument("--chatter", action="store_true", help="print to stdout on every call")
    group.add_argument(
        "--only-slot",
        type=int,
        metavar="S",
        help="inject these faults only in the pool's worker of slot S (one straggler, one crasher)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the random faults")


def plan_from_args(args: argparse.Namespace) -> FaultPlan:
    """The plan named by the flags :func:`add_fault_arguments` added."""
    return FaultPlan(**{field.name: getattr(args, field.name) for field in dataclasses.fields(FaultPlan)})


def instance_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """This process's instance as its pool named it (``"SLOT:START"``), or None if started by hand."""
    return environ.get(INSTANCE_ENV) or None


class FaultInjector:
    """Counts calls and decides, for each, which fault (if any) the plan injects.

    ``instance`` (see the module doc) gives each process of a pool its own random schedule.
    """

    def __init__(self, plan: FaultPlan, instance: str | None = None) -> None:
        slot = None if instance is None else int(instance.split(":", 1)[0])
        if plan.only_slot is not None and slot is not None and slot != plan.only_slot:
            plan = FaultPlan(seed=plan.seed)  # another slot's worker: a healthy one
        self.plan = plan
        self.calls = 0
        self._random = random.Random(plan.seed if instance is None else f"{plan.seed}/{instance}")

    def next_call(self, inputs: list[str]) -> Fault | None:
        """The fault for the next call on ``inputs``; crashes win over hangs over bad inputs."""
        self.calls += 1
        plan, call = self.plan, self.calls
        # Always draw both numbers, so one fault rate does not shift the other's sequence.
        crash_draw, hang_draw = self._random.random(), self._random.random()
        if call == plan.crash_on_call or crash_draw < plan.crash_prob:
            return Fault.CRASH
        if call == plan.hang_on_call or hang_draw < plan.hang_prob:
            return Fault.HANG
        if plan.poison is not None and any(plan.poison in text for text in inputs):
            return Fault.POISON
        if call == plan.wrong_count_on_call:
            return Fault.WRONG_COUNT
        if call == plan.garbage_on_call:
            return Fault.GARBAGE
        return None

    def poison_message(self, inputs: list[str]) -> str:
        """The error a poisoned call reports: which position held the marker."""
        poison = self.plan.poison
        assert poison is not None, "only a poisoned call (Fault.POISON) reports it"
        position = next(i for i, text in enumerate(inputs) if poison in text)
        return f"model raised on input {position}: contains poison marker {poison!r}"
