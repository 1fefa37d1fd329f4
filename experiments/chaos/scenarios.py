"""The rows of the chaos suite: for each fault, the gateway it runs against, the traffic, what
the fault is, and what its clients may be told (docs/fixed-mode.md, "What happens when a worker
fails"; docs/http-api.md, "Errors").

Every scenario runs against the embedded default's shape: paid and free tiers (1 s and 300 ms
wait budgets), a fixed-mode model of ``sleep`` workers (200 ms a call, batches of up to 50,
flushed at 150 ms), ``hang_timeout`` 1 s. ``Params`` scales the load; the fault's own settings
(how often, how long) scale with the run's duration.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable

from experiments.chaos import faults, leaving, scaling
from experiments.chaos.checks import Rules
from experiments.chaos.faults import Run
from experiments.chaos.ray_nodes import SLOT
from experiments.chaos.traffic import Plan, Shot

PAID, FREE = "sk-chaos-paid-0001", "sk-chaos-free-0002"
KEYS = {"paid": PAID, "free": FREE}
MODEL = "chaos"
PAID_BUDGET, FREE_BUDGET, HANG_TIMEOUT = 1.0, 0.3, 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Params:
    rate: float = 300.0
    duration: float = 15.0
    workers: int = 8
    seed: int = 0
    dispatch_ahead_ms: float = 0.0  # the fixed-mode rows' ``dispatch_ahead_ms`` (0: off, the default)


def fixed_model(worker: list[str], workers: int) -> str:
    """The fixed-mode model most rows serve: ``worker`` processes of the reference shape."""
    argv = ", ".join(f'"{arg}"' for arg in worker)
    return f"""
[[models]]
name = "{MODEL}@1"
aliases = ["{MODEL}"]
workers = {workers}
worker = [{argv}]
max_batch = 50
max_wait_ms = 150
hang_timeout_ms = {HANG_TIMEOUT * 1000:.0f}
"""


def continuous_model(worker: list[str], workers: int) -> str:
    """A continuous-mode model on simulated engines (``worker`` names the preset): seeded ASCII
    tokens a character each, steps as long as the preset's GPU would take them."""
    return f"""
[[models]]
name = "{MODEL}@1"
aliases = ["{MODEL}"]
mode = "continuous"
simulated = "{worker[0]}"
workers = {workers}
num_blocks = 512
stats_timeout_ms = 2000
"""


def resuming_model(worker: list[str], workers: int) -> str:
    """:func:`continuous_model` whose streams go on on another engine when theirs dies."""
    return continuous_model(worker, workers) + 'on_engine_loss = "resume"\n'


def config(model: str, redis_url: str | None = None, per_minute: dict[str, int] | None = None) -> str:
    """The row's ``ferry serve`` config around its model table; with ``redis_url`` its keys'
    limits live in Redis (generous limits: the row checks they keep working, not that they bite),
    and ``per_minute`` limits the named tiers' keys to so many requests a minute (limits that bite)."""
    limits = "" if redis_url is None else f'\n[limits]\nstore = "redis"\nredis_url = "{redis_url}"\n'
    per_key = "" if redis_url is None else "\ntokens_per_minute = 100000000"
    paid, free = (per_key if tier not in (per_minute or {}) else
                  f"{per_key}\nrequests_per_minute = {per_minute[tier]}" for tier in ("paid", "free"))
    return limits + f"""
[server]
host = "127.0.0.1"
ping_interval_ms = 100
shutdown_grace_ms = 5000

[[tiers]]
name = "paid"
wait_budget_ms = {PAID_BUDGET * 1000:.0f}
[[tiers]]
name = "free"
wait_budget_ms = {FREE_BUDGET * 1000:.0f}

[[keys]]
key = "{PAID}"
tenant = "chaos"
tier = "paid"{paid}
[[keys]]
key = "{FREE}"
tenant = "chaos"
tier = "free"{free}
""" + model


Fault = Callable[[Run], Awaitable[list[Shot] | None]]  # a fault that is itself clients returns their shots


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    what: str  # the row's fault, in a few words
    worker: tuple[str, ...] = ("sleep", "--latency-ms", "200")
    fault: Fault | None = None
    rules: Rules = Rules()
    plan: dict = dataclasses.field(default_factory=dict)  # Plan fields beyond rate/duration/seed
    workers: int | None = None  # worker processes, if not the run's own number
    redis: bool = False  # the keys' limits live in a redis-server the row starts
    model: Callable[[list[str], int], str] = fixed_model  # the model table: fixed, or continuous
    exit_code: int = 0  # what ``ferry serve`` must exit with at the end
    start_fails: bool = False  # the gateway must refuse to start, saying why
    ray: bool = False  # the workers are Ray actors on a cluster of two worker nodes the row starts
    partition: bool = False  # with ray: one of the two nodes in a network namespace, behind a veth link
    closes: bool = False  # the fault ends the gateway: a request not answered by then may go unanswered
    per_minute: dict[str, int] | None = None  # requests a minute of each tier's key the row limits
    rate: float | None = None  # requests/s, if not the run's own
    duration: float | None = None  # seconds of traffic, if not the run's own

    def own(self, params: Params) -> Params:
        """The run's parameters with the row's own rate and duration, where it has them."""
        rate, duration = self.rate or params.rate, self.duration or params.duration
        return dataclasses.replace(params, rate=rate, duration=duration)

    def toml(self, params: Params, redis_url: str | None = None, ray_address: str | None = None) -> str:
        model = self.model(list(self.worker), self.workers or params.workers)
        if params.dispatch_ahead_ms and self.model is fixed_model:
            model += f"dispatch_ahead_ms = {params.dispatch_ahead_ms:g}\n"
        if ray_address is not None:
            model += f'placement = "ray"\nresources = {{ {SLOT} = 1 }}\n\n[ray]\naddress = "{ray_address}"\n'
        return config(model, redis_url, self.per_minute)


def _kill_every(run: Run) -> Awaitable[None]:
    return faults.kill_workers(run, every=2.0 if run.duration >= 10 else run.duration / 4)


def _at(fraction: float, fault: Callable[..., Awaitable[None]], **kwargs) -> Fault:
    """``fault`` at ``fraction`` of the run's traffic; other durations in seconds."""
    return lambda run: fault(run, at=run.duration * fraction, **kwargs)


def _poisoned(shot) -> frozenset[int] | None:
    """A poisoned input fails alone (500) or waits past its budget (529); the rest as usual."""
    return frozenset({500, 529}) if "POISON" in shot.text else None


def _budget_plus_hang(shot) -> float:
    """docs/fixed-mode.md: a request a failing fleet cannot serve is answered by its budget + one hang
    timeout; half a second more for the two loops' hops and the generator on a shared machine."""
    return (PAID_BUDGET if shot.tier == "paid" else FREE_BUDGET) + HANG_TIMEOUT + 0.5


def _down_all_run(run: Run) -> Awaitable[None]:
    """A fresh fleet is ready; from its first crash on (the first batch leaves within a flush,
    its call crashes it), it must stay not ready for the rest of the run."""
    return faults.watch_not_ready(run, after=1.0)


def _redis_out(run: Run, freeze: bool) -> Awaitable[None]:
    return faults.redis_outage(run, at=run.duration * 0.3, length=run.duration / 3, freeze=freeze)


SLEEP = ("sleep", "--latency-ms", "200")
PAID_PER_MINUTE = 600  # bites within seconds at any rate the row runs (half of its requests paid)
BUSY_RATE, BUSY_SECONDS = 2000.0, 8.0  # a busy gateway's charges; docs/STORES.md has what 2 cores make of it
PARTITION_SETTLE = 30.0  # seconds after the link returns for the fleet to be whole and counted once
ELASTIC = functools.partial(scaling.elastic_model, fixed_model)
FLEET_DOWN = Rules(statuses=frozenset({500, 529}), expected=None, answer_within=_budget_plus_hang)

SCENARIOS = [
    Scenario("baseline", "no fault"),
    Scenario("worker-kills", "SIGKILL a random worker every 2 s", fault=_kill_every),
    Scenario("idle-deaths", "SIGKILL every worker at once while all are idle",
             fault=_at(0.5, faults.kill_idle_fleet), plan={"quiet": (0.4, 0.2)}),
    Scenario("hung-worker", "one worker hangs on 5 % of its calls",
             worker=(*SLEEP, "--hang-prob", "0.05", "--only-slot", "0"),
             rules=Rules(statuses=frozenset({500, 529}))),
    Scenario("straggler", "one worker 5x slower than the others",
             worker=(*SLEEP, "--slow-factor", "5", "--only-slot", "0"),
             rules=Rules(statuses=frozenset({500, 529}))),
    Scenario("poison", "0.5 % of inputs fail the model", worker=(*SLEEP, "--poison", "POISON"),
             rules=Rules(allowed=_poisoned), plan={"poison_share": 0.005}),
    Scenario("wrong-count", "each worker's 3rd call returns one output too few",
             worker=(*SLEEP, "--wrong-count-on-call", "3")),
    Scenario("garbage-frames", "each worker's 5th answer is not msgpack",
             worker=(*SLEEP, "--garbage-on-call", "5")),
    Scenario("crash-on-first-call", "every worker crashes on its first call",
             worker=(*SLEEP, "--crash-on-call", "1"), rules=FLEET_DOWN, fault=_down_all_run),
    Scenario("crash-at-start-up", "the workers cannot start", worker=("sleep", "--latency-ms", "-1"),
             start_fails=True),
    Scenario("sigterm", "SIGTERM the gateway under load", fault=_at(0.5, faults.terminate_gateway),
             rules=Rules(statuses=frozenset({500, 503, 529})), closes=True),
    Scenario("gateway-sigkill", "SIGKILL the gateway under load: every answer a client got is billed",
             fault=_at(0.5, faults.kill_gateway), closes=True, exit_code=-9, rules=Rules(cut_streams=True)),
    Scenario("disconnects", "30 % of clients leave mid-queue or mid-stream", plan={"give_up_share": 0.3}),
    Scenario("whole-disconnects", "100 clients/s beside the traffic leave as their whole answers are written",
             fault=lambda run: leaving.leave_as_answered(run, KEYS, MODEL, rate=100.0, window=(0.15, 0.5))),
    Scenario("idle-flood", "500 idle connections held open",
             fault=_at(0.2, faults.hold_connections, count=500, hold=5.0)),
    Scenario("slow-loris", "300 connections sending half a request",
             fault=_at(0.2, faults.hold_connections, count=300, hold=5.0,
                       partial=b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: ")),
    Scenario("burst-5x", "5x the rate for 2 s, on 2 workers: 3x their capacity", workers=2,
             plan={"burst": (0.2, 0.15, 5.0)}),
    Scenario("engine-kills", "continuous mode: SIGKILL one of 2 engines every 2 s, half the answers streamed",
             worker=("smollm2-135m",), model=continuous_model, workers=2, fault=_kill_every,
             rules=Rules(statuses=frozenset({500, 529}), expected=None),
             plan={"stream_share": 0.5, "max_tokens": 32}),
    Scenario("engine-kills-resume", "engine-kills, streams resumed: no stream ends with an error",
             worker=("smollm2-135m",), model=resuming_model, workers=2, fault=_kill_every,
             rules=Rules(statuses=frozenset({500, 529}), expected=None, stream_errors=False),
             plan={"stream_share": 0.5, "max_tokens": 32}),
    Scenario("ray-actor-kills", "Ray placement: SIGKILL a random worker's actor every 2 s", fault=_kill_every,
             ray=True),
    Scenario("ray-node-loss", "Ray placement: the node holding most workers is lost (raylet killed)",
             fault=_at(0.4, faults.lose_node), ray=True, rules=Rules(statuses=frozenset({500, 529}))),
    Scenario("ray-partition", "Ray placement: one node's network link down for a fifth of the run, then up",
             fault=lambda run: faults.partition_node(run, at=run.duration * 0.3, length=run.duration * 0.2,
                                                     settle=PARTITION_SETTLE),
             ray=True, partition=True, rules=Rules(statuses=frozenset({500, 529}))),
    Scenario("scale-down-under-load", "scaler at 1..4 workers: a 4x burst grows the fleet, then workers "
             "leave while traffic flows", model=ELASTIC, workers=4, fault=scaling.watch_scale_down,
             plan={"burst": (0.1, 0.3, 4.0)}),
    Scenario("kill-during-scale-up", "scaler at 1..4 workers, a 4x burst: the first 2 workers it starts are "
             "SIGKILLed while starting", model=ELASTIC, workers=4, fault=scaling.kill_starting,
             plan={"burst": (0.1, 0.3, 4.0)}),
    Scenario("pool-eviction", "a one-slot pool shared with another version, asked in the model's quiet gap: "
             "each evicts the other, the model's requests wait for the slot",
             model=functools.partial(scaling.pooled_model, fixed_model), rate=100.0,
             fault=lambda run: scaling.evict_in_the_gap(run, PAID, at=run.duration * 0.35),
             plan={"quiet": (0.3, 0.3)}, rules=Rules(statuses=frozenset({503, 529}))),
    Scenario("redis-stop", "Redis stopped for a third of the run, then restarted (limits in Redis)",
             redis=True, fault=lambda run: _redis_out(run, freeze=False)),
    Scenario("redis-freeze", "Redis frozen (SIGSTOP) for a third of the run (limits in Redis)",
             redis=True, fault=lambda run: _redis_out(run, freeze=True)),
    Scenario("redis-busy", f"Redis healthy, the paid key limited to {PAID_PER_MINUTE} requests a minute",
             redis=True, per_minute={"paid": PAID_PER_MINUTE}, rules=Rules(statuses=frozenset({429, 529})),
             fault=lambda run: faults.watch_limits(run, {"paid": PAID_PER_MINUTE})),
    Scenario("redis-busy-2000", f"Redis healthy at {BUSY_RATE:g} requests/s, both keys limited to "
             f"{PAID_PER_MINUTE} a minute", redis=True, rate=BUSY_RATE, duration=BUSY_SECONDS,
             per_minute={"paid": PAID_PER_MINUTE, "free": PAID_PER_MINUTE},
             rules=Rules(statuses=frozenset({429, 529})),
             fault=lambda run: faults.watch_limits(run, {"paid": PAID_PER_MINUTE, "free": PAID_PER_MINUTE})),
]
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}

SHORT = (
    "baseline",
    "worker-kills",
    "poison",
    "garbage-frames",
    "crash-on-first-call",
    "disconnects",
    "sigterm",
    "engine-kills",
    "engine-kills-resume",
)
"""The rows CI runs (experiments/tests/system/test_chaos.py), seconds each, fixed seeds."""
SHORT_PARAMS = Params(rate=150.0, duration=3.0, workers=2, seed=7)


def plan_for(scenario: Scenario, params: Params) -> Plan:
    """The scenario's traffic at these parameters; its burst and quiet windows are fractions
    of the run's duration."""
    fields = dict(scenario.plan)
    for name in ("burst", "quiet"):
        if name in fields:
            start, length, *rest = fields[name]
            fields[name] = (start * params.duration, length * params.duration, *rest)
    return Plan(rate=params.rate, duration=params.duration, seed=params.seed, **fields)
