"""Fidelity of the continuous mode: virtual time against a real SmolLM2 engine worker on this CPU.

    python -m experiments.continuous_fidelity [--costs FILE] [--requests 100] [--rate 1.5] [--seed 0]

One seeded workload (Poisson arrivals, uniform prompt and answer lengths, one tier, greedy
answers) goes twice through the production ``EnginePool``, router and admission with one
replica: once on the wall clock to a real engine worker process (``python -m workers engine``,
SmolLM2-135M-Instruct in bfloat16 on one torch thread), once under MockClock to a simulated
engine (the same engine scheduler over a runner priced by the constants ``ferry fit`` measured
on this machine: ``--costs``, or by default the steps of two ``ferry fit`` runs, one just before
the real run and one just after, fitted together into ``results/continuous_fidelity_costs.json``: on
a shared machine other processes' load changes from minute to minute, and the two bracket it). Both
are driven by the replay's own driver (:func:`batcher.sim.continuous.replay.drive`), so a request is
sent, streamed and timed the same way. A real answer can end early at an end-of-sequence token;
the virtual run asks each request for the tokens its real answer took, so both compute the same
tokens. The real run is bounded by ``--limit`` seconds after its warm-up.

Reported: TTFT and TPOT at p50, p95 and p99 of both runs, their relative difference
(virtual / real - 1), the engine steps, tokens per second and busy seconds of each; and the
same virtual run with every step slowed to the share of a core the real engine process got
(its CPU seconds over the run's wall seconds: on a shared machine other processes take the
rest); a CDF plot of the real and the plain virtual run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Finished, Job, Sampling
from batcher.core.config import QueueConfig
from batcher.placement.local import process_workers
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import IdText, Outcomes, Prompts, Replayed, drive, replay
from batcher.sim.continuous.report import ContinuousReport
from batcher.sim.continuous.workload import Lengths, Workload
from experiments.common import RESULTS, plt, write
from workers.engine.cost_model import SMOLLM2_135M, CostModel, Overhead
from workers.engine.fit import cost_fit

ENGINE = {  # the one replica, real or simulated
    "name": "smollm2@fidelity",
    "workers": 1,
    "num_blocks": 2048,
    "max_batch_tokens": 512,
    "max_seqs": 64,
    "temperature": 0.0,  # greedy, as ferry fit measures
}
REAL = ContinuousModelConfig(model="smollm2-135m", dtype="bfloat16", threads=1, **ENGINE)
VIRTUAL = ContinuousModelConfig(simulated="smollm2-135m", **ENGINE)
QUEUE = QueueConfig(tiers=("all",), queue_timeout=600.0)  # nothing shed, nothing expires
WARM_UP = 4  # requests the real engine answers before the clock starts (its kernels' set-up)


@dataclasses.dataclass(frozen=True)
class KeptRunners(EngineSpec):
    """An engine spec that keeps the runners it makes: their ``total_seconds`` is the time the
    simulated engines spent in steps."""

    kept: list = dataclasses.field(default_factory=list)

    def runner(self):
        made = EngineSpec.runner(self)
        self.kept.append(made)
        return made


def simulate(workload: Workload, cost: CostModel, seed: int) -> tuple[Replayed, float]:
    """``workload`` through the pool to a simulated engine priced by ``cost``, in virtual time;
    and the seconds its engine spent in steps."""
    spec = KeptRunners(**{f.name: getattr(EngineSpec.of(VIRTUAL, cost), f.name)
                          for f in dataclasses.fields(EngineSpec)})
    run = replay(workload, VIRTUAL, QUEUE, spec, seed=seed)
    return run, sum(runner.total_seconds for runner in spec.kept)


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload.synthetic(
        poisson(args.rate, 2 * args.requests / args.rate, args.seed)[: args.requests],
        {"all": 1.0},
        Lengths.parse(args.prompt),
        Lengths.parse(args.answer),
        seed=args.seed,
    )


async def warm_up(pool) -> None:
    left = [WARM_UP]
    done = trio.Event()

    def ended(event: object) -> None:
        if isinstance(event, Finished):
            left[0] -= 1
            if not left[0]:
                done.set()

    for i in range(WARM_UP):
        pool.submit(Job("", tuple(range(100 + i, 164 + i * 64)), Sampling(8), stream=True), ended)
    await done.wait()


def cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds process ``pid`` has used (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve_real(workload: Workload, seed: int, limit: float) -> tuple[Outcomes, dict[str, float], float]:
    """``workload`` through the pool to a real engine worker: what callers saw, the engine's
    counters over the run (and its CPU seconds), the wall seconds from the first arrival to the
    last end."""
    spawn = process_workers(REAL.engine_argv(), REAL.workers, kind=EngineProcess)
    outcomes = Outcomes(len(workload))
    prompts = Prompts(workload, SMOLLM2_135M.vocab, seed)
    async with open_engine_pool(REAL, QUEUE, spawn, IdText()) as pool:
        await warm_up(pool)
        await trio.sleep(0.3)  # a stats frame after the warm-up
        before = pool.snapshot().counters.replicas[0].engine
        pid = pool.snapshot().status.workers[0].pid
        cpu = cpu_seconds(pid)
        done = trio.Event()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive, pool, workload, prompts, outcomes, done, True)
            with trio.move_on_after(limit):
                await done.wait()
            nursery.cancel_scope.cancel()
        span = trio.current_time() - start
        cpu = cpu_seconds(pid) - cpu
        await trio.sleep(0.3)
        after = pool.snapshot().counters.replicas[0].engine
    names = {"steps": "step", **{n: n for n in ("preemptions", "prefix_queries", "prefix_hits",
                                               "computed_tokens", "generated_tokens")}}
    counters = {name: getattr(after, field) - getattr(before, field) for name, field in names.items()}
    return outcomes, {**counters, "cpu_seconds": cpu}, span


def as_asked(workload: Workload, real: Outcomes) -> Workload:
    """``workload`` asking each request for the tokens its real answer took: those it sent,
    plus the end-of-sequence token it stopped at (computed, never sent) if it stopped early."""
    early = real.tokens < workload.answer
    answer = np.where(early & (real.tokens > 0), real.tokens + 1, workload.answer)
    return dataclasses.replace(workload, answer=answer.astype(np.int64))


BEFORE, COSTS = RESULTS / "continuous_fidelity_before.json", RESULTS / "continuous_fidelity_costs.json"


def ferry_fit(out: Path, *earlier: Path) -> None:
    print(f"measuring the engine's steps: ferry fit --out {out}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    argv = ["fit", "--out", str(out), *(f"--with={path}" for path in earlier)]
    subprocess.run([sys.executable, "-m", "gateway.cli", *argv], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", metavar="FILE", help="step costs from ferry fit (default: fit now)")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per second (Poisson)")
    parser.add_argument("--prompt", default="uniform:16:256", help="prompt tokens (default uniform:16:256)")
    parser.add_argument("--answer", default="uniform:16:96", help="answer tokens (default uniform:16:96)")
    parser.add_argument("--limit", type=float, default=180.0, help="wall seconds the real run may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = workload_of(args)
    if not args.costs:  # steps measured just before and just after the real run, fitted together
        RESULTS.mkdir(exist_ok=True)
        ferry_fit(BEFORE)
    print(f"real engine worker: {len(workload)} requests over {workload.times[-1]:.0f} s", file=sys.stderr)
    cpu, load = time.process_time(), os.getloadavg()[0]
    outcomes, counters, span = trio.run(serve_real, workload, args.seed, args.limit)
    load = (load, os.getloadavg()[0])
    real = Replayed(workload, outcomes, [counters], np.zeros((0, 1)), [0], span, time.process_time() - cpu, 0)
    if args.costs:
        cost, fitted = cost_fit.load(args.costs), f"`{args.costs}`"
    else:
        ferry_fit(COSTS, BEFORE)
        cost, fitted = cost_fit.load(str(COSTS)), "the steps `ferry fit` timed just before and after it"
    asked = as_asked(workload, outcomes)
    share = min(1.0, counters["cpu_seconds"] / span)  # of a core, as the real engine got it
    virtual, stepping = simulate(asked, cost, args.seed)
    slowed = Overhead(*(value / share for value in dataclasses.astuple(cost.overhead)))
    at_share, stepping_at_share = simulate(asked, CostModel(cost.shape, cost.hardware, slowed), args.seed)
    runs = {"virtual": virtual, "real": real, "shared": at_share}
    reports = {name: ContinuousReport.of(run) for name, run in runs.items()}
    rows, judged = [], []

    def row(label: str, v: float, r: float, s: float) -> None:
        rows.append({"": label, "virtual": round(v, 1), "real": round(r, 1),
                     "virtual / real - 1": f"{v / r - 1:+.1%}",
                     f"virtual at {share:.0%} of a core": round(s, 1),
                     "at share / real - 1": f"{s / r - 1:+.1%}"})

    for metric in ("ttft", "tpot"):
        for p in ("p50", "p95", "p99"):
            v, r, s = (getattr(reports[k].by_tier["all"], metric)[p] * 1000 for k in runs)
            row(f"{metric.upper()} {p} ms", v, r, s)
            if p != "p99":
                judged.append(100 * abs(v / r - 1))
    for label, key in (("engine steps", "steps"), ("tokens/s", "tokens_per_second")):
        row(label, *(getattr(reports[k].replicas[0], key) for k in runs))
    row("engine busy s (virtual: in steps; real: CPU)", stepping, counters["cpu_seconds"], stepping_at_share)
    ended = {k: reports[k].by_tier["all"].ended["finished"] for k in reports}
    early = int(((outcomes.tokens < workload.answer) & (outcomes.tokens > 0)).sum())
    worst = max(judged)

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (name, unit) in zip(axes, (("TTFT", "ms"), ("TPOT", "ms")), strict=True):
        curves = (("virtual time", virtual, "-"), ("real engine worker", real, "--"),
                  (f"virtual, {share:.0%} of a core", at_share, ":"))
        for label, run, style in curves:
            out = run.outcomes
            tpot = (out.end - out.first) / np.maximum(out.tokens - 1, 1)
            values = out.first - out.sent if name == "TTFT" else tpot
            ordered = np.sort(values[out.tokens > 1]) * 1000
            axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), style, label=label)
        axis.set(title=name, xlabel=f"{name} ({unit})", ylabel="share of requests")
        axis.grid(alpha=0.3)
    axes[0].legend()
    verdict, o = "within" if worst <= 15 else "NOT within", cost.overhead
    summary = f"""
{len(workload)} requests ({args.rate:g}/s Poisson, prompts {args.prompt}, answers {args.answer},
seed {args.seed}) through the production pool to one SmolLM2-135M engine: a real worker process
(bfloat16, one torch thread, {ended['real']} finished, {early} ended early at an end-of-sequence
token; the engine process used {counters['cpu_seconds']:.0f} CPU s in the run's {span:.0f} wall s,
the machine's load average went from {load[0]:.1f} to {load[1]:.1f} on its 2 cores) against a
simulated engine priced by {fitted} ({ended['virtual']} finished; per step {o.step * 1e3:.1f} ms,
per sequence {o.seq * 1e3:.2f} ms, per token {o.token * 1e3:.2f} ms, per context token
{o.context * 1e6:.1f} µs, per attention pair {o.pair * 1e9:.2f} ns). The largest
TTFT/TPOT p50/p95 difference is **{worst:.1f} %**: {verdict} the 15 % asked for. The last two
columns price every step at the share of a core the real engine got (its CPU seconds over the
run's wall seconds, {share:.0%}): what the simulation says once the other processes' load is known.
"""
    command = " ".join(["python -m experiments.continuous_fidelity", *sys.argv[1:]])
    write("continuous_fidelity", rows, figure, summary, command)


if __name__ == "__main__":
    main()
