"""``python -m experiments.chaos``: run the scenarios, print each verdict, write the report.

    .venv/bin/python -m experiments.chaos                       # every row -> docs/RELIABILITY.md
    .venv/bin/python -m experiments.chaos --only worker-kills --rate 1000 --duration 60
    .venv/bin/python -m experiments.chaos --short               # the rows CI runs, seconds each
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

from experiments.chaos.checks import Verdict, judge
from experiments.chaos.faults import Clock, Run
from experiments.chaos.leaving import unreceived
from experiments.chaos.ray_nodes import RayNodes
from experiments.chaos.ray_partition import PartitionedNodes, unavailable
from experiments.chaos.scenarios import (
    BY_NAME,
    KEYS,
    MODEL,
    SCENARIOS,
    SHORT,
    SHORT_PARAMS,
    Params,
    Scenario,
    plan_for,
)
from experiments.chaos.server import Server, StartFailed
from experiments.chaos.traffic import send
from experiments.generator_gc import collector_off
from gateway.accounting.fallback import REDIS_CONNECTIONS
from gateway.http import event_loop
from tests.support.redis_server import RedisServer

REPORT = pathlib.Path(__file__).resolve().parent.parent.parent / "docs" / "RELIABILITY.md"
SETTLE = 1.0  # seconds after the traffic before the leak check: queues drain, sockets close
THREADS_SLACK = 2  # threads the gateway may hold beyond its count before the traffic
POOLS_IDLE = 12.0
"""Seconds more the leak check waits for threads over the slack to end: trio's cached worker
threads end after 10 s idle, and a Ray driver's gRPC pools (``event_engine``, the timer
manager's) grow under a node loss and shrink after; a leaked thread stays."""


async def run(scenario: Scenario, params: Params, workdir: pathlib.Path) -> Verdict:
    """One row: start the gateway (and its Redis), send the traffic beside the fault, judge
    every answer."""
    if scenario.partition and (why := unavailable()):
        verdict = Verdict(scenario.name)
        verdict.notes.append(f"skipped: {why}")
        return verdict
    redis: RedisServer | None = None
    ray: RayNodes | PartitionedNodes | None = None
    if scenario.redis:
        redis = RedisServer(workdir / "redis")
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        redis.start()
    try:
        if scenario.ray:
            nodes = PartitionedNodes if scenario.partition else RayNodes
            ray = nodes(scenario.workers or params.workers)  # this thread: Ray's daemons die with theirs
        with collector_off():  # a pause of this process's collector would be timed as the gateway's
            return await _run(scenario, params, workdir, redis, ray)
    finally:
        if redis is not None:
            redis.stop()
        if ray is not None:
            ray.stop()


async def _run(scenario: Scenario, params: Params, workdir: pathlib.Path, redis: RedisServer | None,
               ray: RayNodes | PartitionedNodes | None) -> Verdict:
    began = time.monotonic()
    try:
        toml = scenario.toml(params, redis.url if redis else None, ray.address if ray else None)
        server = await asyncio.to_thread(Server, toml, workdir)
    except StartFailed as exc:
        verdict = Verdict(scenario.name)
        if not scenario.start_fails:
            verdict.violate(f"the gateway did not start: {exc}")
        verdict.notes.append(f"refused to start in {time.monotonic() - began:.1f} s: {exc}")
        return verdict
    if scenario.start_fails:
        server.stop()
        verdict = Verdict(scenario.name)
        verdict.violate("the gateway started although its workers cannot")
        return verdict
    await asyncio.to_thread(server.wait_ready)
    before = server.resources()
    clock = Clock()
    plan = plan_for(scenario, params)
    traffic = asyncio.ensure_future(send(plan, server.url, KEYS, MODEL))
    context = Run(server, clock, params.duration, params.seed, redis, ray)
    fault = asyncio.ensure_future(scenario.fault(context)) if scenario.fault else None
    shots = await traffic
    if fault is not None:
        shots += await fault or []  # a fault that is itself clients returns their shots
    await asyncio.sleep(SETTLE)
    alive = server.process.poll() is None
    after = await _settled(server, before) if alive else None
    queued = _queued(server) if alive else 0
    code = await asyncio.to_thread(server.stop)
    rules = scenario.rules
    if scenario.closes and clock.times:
        rules = dataclasses.replace(rules, closed_after=clock.times[0])
    usage = server.usage()
    verdict = judge(scenario.name, shots, usage, rules, clock.times, clock.problems)
    verdict.notes.extend(clock.notes)
    if overloaded := _overloaded(usage):
        verdict.notes.append(f"529s by tier and outcome: {overloaded}")
    if left := unreceived(shots, usage):
        verdict.notes.append(left)
    if after is not None:
        verdict.resources = {name: (before[name], after[name]) for name in before}
        pools = REDIS_CONNECTIONS if scenario.redis else 0  # a bounded pool that warmed up is no leak
        if after["fds"] > before["fds"] + 16 + pools:
            verdict.violate(f"file descriptors grew from {before['fds']} to {after['fds']}")
        if after["threads"] > before["threads"] + THREADS_SLACK:
            verdict.violate(f"threads grew from {before['threads']} to {after['threads']}")
    if queued:
        verdict.violate(f"{queued} requests still queued after the traffic ended")
    if code != scenario.exit_code:
        verdict.violate(f"ferry serve exited {code}, not {scenario.exit_code}")
    return verdict


async def _settled(server: Server, before: dict[str, int]) -> dict[str, int]:
    """The gateway's resources, once threads over the slack had :data:`POOLS_IDLE` to end."""
    after, waited = server.resources(), 0.0
    while after["threads"] > before["threads"] + THREADS_SLACK and waited < POOLS_IDLE:
        await asyncio.sleep(0.5)
        waited += 0.5
        after = server.resources()
    return after


def _overloaded(usage: list) -> str:
    """The 529s, whole or in a stream, by tier (the key's id names it) and outcome: shed at
    admission, or expired in the queue."""
    tiers = {hashlib.sha256(key.encode()).hexdigest()[:12]: tier for tier, key in KEYS.items()}
    counts = collections.Counter((tiers.get(r.key_id, "?"), r.outcome) for r in usage
                                 if r.outcome in ("shed", "expired"))
    return ", ".join(f"{tier} {outcome} {n}" for (tier, outcome), n in sorted(counts.items()))


def _queued(server: Server) -> int:
    models = server.get("/readyz")[1].get("models", {})
    return sum(model.get("queued", 0) for model in models.values())


def row(verdict: Verdict, command: str) -> str:
    documented = ", ".join(f"{k}: {v}" for k, v in sorted(verdict.documented.items())) or "-"
    recovery = "-" if verdict.recovery_s is None else f"{verdict.recovery_s:.2f} s"
    p99 = "-" if verdict.p99_ms != verdict.p99_ms else f"{verdict.p99_ms:.0f} ms"
    status = "clean" if verdict.clean else f"**{len(verdict.violations)} violations**"
    return (f"| {verdict.name} | {verdict.sent} | {verdict.succeeded} | {documented} | {verdict.gave_up} | "
            f"{verdict.lost} | {verdict.duplicated} | {p99} | {recovery} | {status} | `{command}` |")


HEADER = ("| fault | sent | succeeded | documented errors | gave up (on purpose) | lost | duplicated | p99 | "
          "time to recover | checks | command |\n|---|---|---|---|---|---|---|---|---|---|---|")


async def main(args: argparse.Namespace) -> int:
    names = SHORT if args.short else (args.only or [s.name for s in SCENARIOS])
    base = SHORT_PARAMS if args.short else Params()
    params = dataclasses.replace(base, **{k: v for k, v in vars(args).items()
                                          if k in ("rate", "duration", "workers", "seed", "dispatch_ahead_ms")
                                          and v is not None})
    rows, verdicts = [], []
    with tempfile.TemporaryDirectory(prefix="ferry-chaos-") as scratch:
        for name in names:
            own = BY_NAME[name].own(params)  # a row with a rate or duration of its own runs at it
            verdict = await run(BY_NAME[name], own, pathlib.Path(scratch) / name)
            command = (f".venv/bin/python -m experiments.chaos --only {name} --rate {own.rate:g} "
                       f"--duration {own.duration:g} --workers {own.workers} --seed {own.seed}"
                       + (f" --dispatch-ahead-ms {own.dispatch_ahead_ms:g}" if own.dispatch_ahead_ms else ""))
            rows.append(row(verdict, command))
            verdicts.append(verdict)
            print(rows[-1], flush=True)
            for line in verdict.violations + verdict.notes:
                print(f"    {line}", flush=True)
    if args.report:
        write_report(pathlib.Path(args.report), rows, verdicts, params)
    return 0 if all(v.clean for v in verdicts) else 1


def write_report(path: pathlib.Path, rows: list[str], verdicts: list[Verdict], params: Params) -> None:
    notes = [f"- **{v.name}**: {line}" for v in verdicts for line in v.notes + v.violations]
    resources = [f"- {v.name}: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in v.resources.items())
                 for v in verdicts if v.resources]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# Reliability: what each fault costs

Written by `.venv/bin/python -m experiments.chaos --report` ({time.strftime('%Y-%m-%d')},
the 2-core development machine, gateway and load generator side by side). Each row starts a
fresh `ferry serve` (8 `sleep` workers of 200 ms unless the row says otherwise; paid budget
1 s, free 300 ms, `hang_timeout` 1 s), offers Poisson traffic at {params.rate:g} requests/s for
{params.duration:g} s (half paid, 30 % streamed), injects the fault, and checks every answer:
its status is one the row documents, its body is well formed, its text is its own input's
answer, exactly one usage record agrees with what the client got, and the gateway's
descriptors and threads come back (`experiments/chaos/__init__.py` has the rules). "Lost" is a
request that got no answer where one was owed; "duplicated" one answered or recorded twice.
Both must be 0 in every row. "Time to recover" is the longest wait, after a fault struck, for
the arrival of the first request that was then served.

{HEADER}
{chr(10).join(rows)}

## What the rows saw

{chr(10).join(notes) or "Nothing beyond the table."}

## The gateway's descriptors, threads and memory (KiB), before the traffic and after it settled

{chr(10).join(resources)}
""")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The chaos suite: faults under load, every answer checked.")
    parser.add_argument("--only", nargs="+", choices=sorted(BY_NAME), help="run these rows only")
    parser.add_argument("--short", action="store_true", help="the rows CI runs, seconds each")
    parser.add_argument("--rate", type=float, help="requests per second (default 300; short: 150)")
    parser.add_argument("--duration", type=float, help="seconds of traffic per row (default 15; short: 3)")
    parser.add_argument("--workers", type=int, help="worker processes (default 8; short: 2)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dispatch-ahead-ms", type=float,
                        help="the fixed-mode rows' dispatch_ahead_ms (default 0: off)")
    parser.add_argument(
        "--report", nargs="?", const=str(REPORT), help="write the report (default docs/RELIABILITY.md)"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(event_loop.run(main(parse_args())))
