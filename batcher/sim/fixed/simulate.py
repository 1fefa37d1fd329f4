"""Virtual-time runs of the production batcher and pool: ``ferry simulate`` and the experiments.

A :class:`Scenario` names everything a run depends on: the arrivals (a :class:`Trace`), the
flush policy by name and parameters (as a config file gives it), the workers, their service
time model and fault rates, and the queue settings. :func:`simulate` runs it under
``trio.testing.MockClock(autojump_threshold=0)`` through the very ``Batcher`` and ``WorkerPool``
that serve real traffic, with in-process :class:`~batcher.sim.fixed.workers.SimulatedWorker` s in place
of GPU processes: an hour of traffic takes a minute of CPU, and the same seed gives the same
answer in a fresh process (:mod:`batcher.sim.virtual`). (Not always twice in one process: trio
breaks ties between timers that expire at the very same virtual instant by object identity, so a
later run may order two such wake-ups the other way; the numbers then differ a little, as
between two seeds.)

The trace is handed to the batcher as a :class:`~batcher.sim.fixed.replay.Replay` feed and every outcome is
recorded into arrays (:class:`~batcher.sim.fixed.report.Recorder`), so neither the clock nor the memory
pays per arrival more than the scheduler itself does.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import math
import operator
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from batcher.core.config import PoolConfig, QueueConfig, ScalerConfig
from batcher.core.scaling import open_scaled
from batcher.fixed.batcher import open_batcher
from batcher.fixed.counters import BatchCounters
from batcher.fixed.elastic import FixedFleet
from batcher.fixed.policy import POLICIES, make_policy
from batcher.fixed.pool import WorkerPool
from batcher.sim.arrivals import Trace, bursty, poisson
from batcher.sim.continuous import simulate as llm_simulate
from batcher.sim.fixed.replay import Replay
from batcher.sim.fixed.report import Recorder, Report, Samples
from batcher.sim.fixed.workers import SimulatedWorker, linear
from batcher.sim.progress import Progress, print_progress
from batcher.sim.virtual import run_virtual
from workers.faults import FaultPlan


@dataclasses.dataclass(frozen=True, slots=True)
class Service:
    """Seconds one call takes: ``fixed + per_input x size``, times a factor within ``1 ± jitter``."""

    fixed: float = 0.200
    per_input: float = 0.0
    jitter: float = 0.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated run. ``timeout`` is the deadline budget of arrivals the trace gives none
    (default: the queue's ``queue_timeout``); ``policy`` and ``params`` go to ``make_policy``."""

    trace: Trace
    policy: str = "size_or_timeout"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    workers: int = 8
    service: Service = Service()
    faults: FaultPlan = FaultPlan()
    queue: QueueConfig = QueueConfig()
    hang_timeout: float = 1.0
    dispatch_ahead: float = 0.0  # PoolConfig.dispatch_ahead
    turnaround: float = 0.0  # the gateway's hop from a result to the next frame (SimulatedWorker)
    timeout: float | None = None
    seed: int = 0
    scaling: ScalerConfig | None = None  # the production scaler, between min and max workers
    start_s: float = 0.0  # seconds a worker takes from spawn to ready

    def with_(self, **changes: Any) -> Scenario:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, slots=True)
class Simulation:
    """A finished run: the report, and what it cost to simulate."""

    scenario: Scenario
    report: Report
    virtual_seconds: float
    cpu_seconds: float
    wall_seconds: float
    samples: Samples
    held: tuple[int, ...]  # workers held (starting, warm, serving or draining), each virtual second

    @property
    def gpu_seconds(self) -> float:
        return float(sum(self.held))

    @property
    def requests_per_cpu_second(self) -> float:
        return self.report.offered / self.cpu_seconds if self.cpu_seconds > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        scenario = self.scenario
        return {
            "scenario": {
                "arrivals": len(scenario.trace),
                "policy": scenario.policy,
                "params": dict(scenario.params),
                "workers": scenario.workers,
                "service": dataclasses.asdict(scenario.service),
                "faults": dataclasses.asdict(scenario.faults),
                "tiers": list(scenario.queue.tiers),
                "timeout": scenario.timeout,
                "seed": scenario.seed,
                "scaling": dataclasses.asdict(scenario.scaling) if scenario.scaling else None,
                "start_s": scenario.start_s,
            },
            "report": self.report.as_dict(),
            "gpu_seconds": self.gpu_seconds,
            "virtual_seconds": self.virtual_seconds,
            "cpu_seconds": self.cpu_seconds,
            "wall_seconds": self.wall_seconds,
            "requests_per_cpu_second": self.requests_per_cpu_second,
        }


class _SeededSpawner:
    """Spawns simulated workers; each one (restarts included) gets its own seed, a function of
    its slot and of how many workers that slot has had, not of the order in which trio happens
    to run the slots' start-ups, so a run is a function of the scenario's seed."""

    def __init__(self, scenario: Scenario) -> None:
        self._scenario = scenario
        self._spawned: collections.Counter[int] = collections.Counter()

    def __call__(self, slot: int) -> SimulatedWorker:
        scenario, number = self._scenario, self._spawned[slot]
        self._spawned[slot] += 1
        seed = scenario.seed * 1_000_003 + scenario.faults.seed * 7_919 + slot * 65_537 + number
        service = linear(scenario.service.fixed, scenario.service.per_input, scenario.service.jitter, seed)
        faults = dataclasses.replace(scenario.faults, seed=seed)
        return SimulatedWorker(service, faults, record=False, turnaround=scenario.turnaround,
                               start_s=scenario.start_s)


def simulate(
    scenario: Scenario, progress: Callable[[Progress], None] | None = None, every: float = 60.0
) -> Simulation:
    """Run ``scenario`` in virtual time until every arrival has been answered or dropped."""
    if not len(scenario.trace):
        raise ValueError("simulate: the trace has no arrival")
    recorder = Recorder(len(scenario.trace))
    pool_log, scaler_log = logging.getLogger("ferry.pool"), logging.getLogger("ferry.scaler")
    level, scaler_level = pool_log.level, scaler_log.level
    pool_log.setLevel(logging.ERROR)  # faults by the thousand: the report counts them
    scaler_log.setLevel(logging.ERROR)  # the wall clock's times mean nothing here: the report counts GPU time
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        (counters, held), virtual = run_virtual(_run, scenario, recorder, progress, every,
                                                       seed=scenario.seed)
    finally:
        pool_log.setLevel(level)
        scaler_log.setLevel(scaler_level)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    elastic = scenario.scaling is not None and scenario.scaling.elastic
    report = recorder.report(scenario.queue.tiers, counters, None if elastic else scenario.workers)
    return Simulation(scenario, report, virtual, cpu, wall, recorder.samples(), held)


async def _run(
    scenario: Scenario, recorder: Recorder, progress: Callable[[Progress], None] | None, every: float
) -> tuple[tuple[BatchCounters, tuple[int, ...]], float]:
    trace, total = scenario.trace, len(scenario.trace)
    budget = scenario.queue.queue_timeout if scenario.timeout is None else scenario.timeout
    deadlines = np.where(np.isnan(trace.deadlines), trace.times + budget, trace.deadlines)
    all_ended = trio.Event()

    def ended(request: Any) -> None:
        recorder(request)
        if recorder.ended == total:
            all_ended.set()

    scaling = scenario.scaling or ScalerConfig(scenario.workers, scenario.workers)
    initial = scaling.min_workers if scaling.elastic else None
    pool = PoolConfig(workers=scaling.slots, hang_timeout=scenario.hang_timeout, initial=initial,
                      start_timeout=max(PoolConfig().start_timeout, 2 * scenario.start_s),
                      dispatch_ahead=scenario.dispatch_ahead)
    policy = make_policy(scenario.policy, **scenario.params)
    spawn = _SeededSpawner(scenario)
    held = GpuTime()
    opened = open_batcher(spawn, pool, policy, scenario.queue)
    async with open_scaled(opened, scaling, FixedFleet, operator.attrgetter("counters"), "sim") as batcher:
        start = trio.current_time()  # the fleet (min_workers of it) is up: the trace starts
        batcher.feed(Replay(batcher, trace.times + start, trace.tier, trace.tiers, deadlines + start, ended))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(held.count, batcher.pool)
            if progress is not None:
                nursery.start_soon(_tell_progress, progress, every, recorder, total, float(trace.times[-1]))
            await all_ended.wait()
            nursery.cancel_scope.cancel()
    return (batcher.counters, tuple(held.each_second)), trio.current_time() - start


class GpuTime:
    """The workers a pool held, read each virtual second from its staffed slots."""

    def __init__(self) -> None:
        self.each_second: list[int] = []

    async def count(self, pool: WorkerPool) -> None:
        while True:
            self.each_second.append(len(pool.workers()))
            await trio.sleep(1.0)


async def _tell_progress(
    progress: Callable[[Progress], None], every: float, recorder: Recorder, total: int, span: float
) -> None:
    start, cpu = trio.current_time(), time.process_time()
    while True:
        await trio.sleep(every)
        now = trio.current_time() - start
        progress(Progress(now, span, recorder.ended, total, time.process_time() - cpu))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ferry simulate``: the fixed mode's, then the continuous mode's."""
    parser.add_argument("--mode", choices=["fixed", "continuous"], default="fixed",
                        help="fixed batches (default) or continuous LLM engines")
    arrivals = parser.add_argument_group("arrivals (Poisson unless --burst or --trace)")
    arrivals.add_argument("--rate", type=float, help="requests per second (default 2000; continuous: 20)")
    arrivals.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    arrivals.add_argument(
        "--burst", metavar="PEAK,ON,OFF", help="on/off: OFF s at --rate, then ON s at PEAK/s, ..."
    )
    arrivals.add_argument("--trace", metavar="CSV", help="replay timestamp,tier[,deadline] rows")
    arrivals.add_argument(
        "--paid-share", type=float, default=0.5, help="share of paid requests (default 0.5)"
    )
    arrivals.add_argument(
        "--deadline-ms", type=float, help="answer due this long after arrival (default: none)"
    )
    policy = parser.add_argument_group("policy")
    policy.add_argument("--policy", default="size_or_timeout", choices=sorted(POLICIES))
    policy.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="policy parameter, repeatable"
    )
    fleet = parser.add_argument_group("workers")
    fleet.add_argument("--workers", type=int, help="workers (default 8), or continuous replicas (default 2)")
    fleet.add_argument("--service-ms", type=float, default=200.0, help="fixed cost of a call (default 200)")
    fleet.add_argument("--per-input-ms", type=float, default=0.0, help="added cost per input in the batch")
    fleet.add_argument("--jitter", type=float, default=0.0, help="each call x U(1-J, 1+J)")
    fleet.add_argument("--crash-prob", type=float, default=0.0, help="a call crashes its worker")
    fleet.add_argument("--hang-prob", type=float, default=0.0, help="a call never returns")
    fleet.add_argument("--hang-timeout-ms", type=float, default=1000.0)
    fleet.add_argument("--dispatch-ahead-ms", type=float, default=0.0,
                       help="a busy worker this near its call's end takes the next batch (default 0: off)")
    fleet.add_argument("--turnaround-ms", type=float, default=0.0,
                       help="the gateway's hop from a result to the next frame sent to an idle worker")
    scaling = parser.add_argument_group("the scaler (docs/operations.md, Scaling)")
    scaling.add_argument("--min-workers", type=int, help="serving workers at least (default: --workers)")
    scaling.add_argument("--max-workers", type=int, help="serving workers at most (default: --workers)")
    scaling.add_argument("--warm-workers", type=int, default=0, help="started, no traffic (default 0)")
    scaling.add_argument("--scale-down-after-s", type=float, default=60.0, help="spare this long: down (60)")
    scaling.add_argument("--idle-after-s", type=float, default=300.0,
                          help="min 0: idle this long, stop (300)")
    scaling.add_argument("--start-s", type=float,
                         help="a worker's spawn to ready, s (default 0; continuous, scaling: 480)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the run as JSON")
    parser.add_argument(
        "--progress-every",
        type=float,
        default=300.0,
        metavar="S",
        help="virtual seconds between progress lines",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    llm_simulate.add_arguments(parser)


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--param: expected KEY=VALUE, got {text!r}")
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario the flags of :func:`add_arguments` describe; ValueError names a bad flag."""
    queue = QueueConfig()
    rate = 2000.0 if args.rate is None else args.rate
    shares = {"paid": args.paid_share, "free": 1.0 - args.paid_share}
    budget = None if args.deadline_ms is None else args.deadline_ms / 1000
    if args.trace:
        trace = Trace.read(args.trace, queue.tiers)
    elif args.burst:
        try:
            peak, on, off = (float(part) for part in args.burst.split(","))
        except ValueError:
            raise ValueError(f"--burst: expected PEAK,ON,OFF, got {args.burst!r}") from None
        trace = Trace.of(bursty(rate, peak, on, off, args.duration, args.seed), shares, args.seed, budget)
    else:
        trace = Trace.of(poisson(rate, args.duration, args.seed), shares, args.seed, budget)
    params = dict(_param(text) for text in args.param)
    for flag in ("dispatch_ahead_ms", "turnaround_ms"):
        if not 0 <= (value := getattr(args, flag)) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')}: expected milliseconds >= 0, got {value}")
    if args.policy == "slack_driven":  # unless told otherwise, it plans with the simulated call's cost
        params.setdefault(
            "service_time", (args.service_ms + args.per_input_ms * params.get("max_batch", 50)) / 1000
        )
    workers = 8 if args.workers is None else args.workers
    low = workers if args.min_workers is None else args.min_workers
    high = max(workers, low) if args.max_workers is None else args.max_workers
    scaling = ScalerConfig(low, high, args.warm_workers, args.scale_down_after_s, args.idle_after_s)
    return Scenario(
        trace,
        policy=args.policy,
        params=params,
        workers=workers,
        service=Service(args.service_ms / 1000, args.per_input_ms / 1000, args.jitter),
        faults=FaultPlan(crash_prob=args.crash_prob, hang_prob=args.hang_prob, seed=args.seed),
        queue=queue,
        hang_timeout=args.hang_timeout_ms / 1000,
        dispatch_ahead=args.dispatch_ahead_ms / 1000,
        turnaround=args.turnaround_ms / 1000,
        timeout=budget,
        seed=args.seed,
        scaling=scaling,
        start_s=args.start_s or 0.0,
    )


def main(args: argparse.Namespace) -> int:
    """``ferry simulate``: run one scenario, print its table, optionally write JSON."""
    if args.mode == "continuous":
        return llm_simulate.main(args)
    try:
        scenario = scenario_from_args(args)
        make_policy(scenario.policy, **scenario.params)
    except (ValueError, OSError) as exc:
        print(f"ferry simulate: {exc}", file=sys.stderr)
        return 2
    trace = scenario.trace
    print(
        f"ferry simulate: {len(trace):,} arrivals over {trace.times[-1]:,.0f} s, policy {scenario.policy} "
        f"{scenario.params or ''}, {scenario.workers} workers"
    )
    run = simulate(scenario, None if args.quiet else print_progress, args.progress_every)
    print(run.report.table())
    print(f"GPU-seconds held: {run.gpu_seconds:,.0f}")
    print(
        f"simulated {run.virtual_seconds:,.1f} virtual s in {run.cpu_seconds:.2f} CPU s "
        f"({run.requests_per_cpu_second:,.0f} requests per CPU second)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(run.as_dict(), out, indent=2)
    return 0
