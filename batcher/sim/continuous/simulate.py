"""``ferry simulate --mode continuous``: LLM traffic through simulated replicas behind the real
router, admission and engine scheduler, in virtual time.

A replica is a model on ``--gpus`` GPUs in tensor parallel, priced by the cost model: a preset
(``--model llama-70b`` on 8 x H100 with 400 GB of KV cache, ``llama-8b`` on one H100 with 60 GB,
``smollm2-135m``) or an explicit shape (``--shape``, ``--params``) and GPU (``--gpu``,
``--bandwidth-tbs``, ``--tflops``), or the step costs ``ferry fit`` measured and wrote
(``--cost FILE``; :mod:`workers.engine.fit.command`). The workload is Poisson (``--rate``), on/off bursts
(``--burst``) or a CSV trace (``--trace``, see :mod:`batcher.sim.continuous.workload`), with length
distributions for prompts and answers, a tier mix, conversations and shared prefixes.

It prints TTFT and TPOT percentiles by tier, how requests ended, and per replica the tokens per
second, engine steps, KV use, preemptions and prefix hit rate (:mod:`batcher.sim.continuous.report`);
``--json`` writes the same numbers, and long runs print progress on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import bursty, poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import replay
from batcher.sim.continuous.report import ContinuousReport
from batcher.sim.continuous.workload import Lengths, Workload
from batcher.sim.progress import Progress, print_progress
from workers.engine.config import DEFAULTS
from workers.engine.cost_model import (
    A100,
    H100,
    H200,
    LLAMA_8B,
    LLAMA_70B,
    SMOLLM2_135M,
    CostModel,
    Hardware,
    ModelShape,
)
from workers.engine.fit import cost_fit

GPUS = {"h100": H100, "h200": H200, "a100": A100}
MODELS: dict[str, tuple[ModelShape, int, float]] = {
    "llama-70b": (LLAMA_70B, 8, 400.0),  # 8 x 80 GB less 140 GB of weights and working memory
    "llama-8b": (LLAMA_8B, 1, 60.0),  # 80 GB less 16 GB of weights and working memory
    "smollm2-135m": (SMOLLM2_135M, 1, 60.0),
}
"""Model presets: the shape, the GPUs of one replica, and the KV cache of one replica in GB."""

DEFAULT_RATE, DEFAULT_REPLICAS = 20.0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only ``--mode continuous`` reads (the arrivals, --seed and --json are shared)."""
    group = parser.add_argument_group("continuous mode (--mode continuous)")
    group.add_argument(
        "--model", choices=sorted(MODELS), default="llama-70b", help="model preset (default llama-70b)"
    )
    group.add_argument(
        "--shape", metavar="L,H,HEADS,KV_HEADS,HEAD_DIM,FFN,VOCAB", help="explicit model shape"
    )
    group.add_argument(
        "--params", type=float, metavar="B", help="parameters in billions (default: from the shape)"
    )
    group.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    group.add_argument("--gpus", type=int, help="GPUs per replica, tensor parallel (default: the preset's)")
    group.add_argument("--gpu-hour-price", type=float, default=0.0, metavar="PRICE",
                       help="what one GPU costs an hour: the report says what a million tokens cost")
    group.add_argument(
        "--bandwidth-tbs", type=float, help="memory bandwidth of one GPU, TB/s (default: --gpu's)"
    )
    group.add_argument("--tflops", type=float, help="dense 16-bit TFLOP/s of one GPU (default: --gpu's)")
    group.add_argument("--kv-gb", type=float, help="KV cache of one replica, GB (default: the preset's)")
    group.add_argument(
        "--cost", metavar="FILE", help="step costs `ferry fit` wrote, in place of the model and GPU flags"
    )
    group.add_argument(  # a GPU replica's budget, four times the engine's default on a CPU
        "--max-batch-tokens", type=int, default=2048, help="token budget of a step (default 2048)"
    )
    group.add_argument("--max-seqs", type=int, default=DEFAULTS.max_seqs,
                       help="running sequences per replica (default %(default)s)")
    group.add_argument(
        "--affinity-bound", type=int, default=2048, help="router's prefix affinity bound, tokens"
    )
    group.add_argument(
        "--prompt", default="1500", metavar="LENGTHS", help="N, uniform:LO:HI or lognormal:MEDIAN:P95"
    )
    group.add_argument(
        "--answer", default="300", metavar="LENGTHS", help="answer tokens, same forms (default 300)"
    )
    group.add_argument(
        "--step-by-step",
        action="store_true",
        help="replay every engine step on its own (default: runs of pure decode steps at once)",
    )
    group.add_argument("--turns", type=int, default=1, help="turns per conversation (default 1)")
    group.add_argument("--prefixes", type=int, default=0, help="shared system prompts (default none)")
    group.add_argument("--prefix-tokens", type=int, default=0, help="tokens of each shared system prompt")
    group.add_argument(
        "--wait-budget-ms", default="2000,500", metavar="PAID,FREE", help="wait budgets by tier"
    )
    group.add_argument(
        "--tpot-target-ms", default="0,0", metavar="PAID,FREE",
        help="TPOT targets by tier, the engines' seat rule (0: none; default none)",
    )


def _number(text: str, name: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: expected integers separated by commas, got {text!r}") from None


def cost_from_args(args: argparse.Namespace) -> tuple[CostModel, float]:
    """The step prices of one replica, and its KV cache in GiB."""
    fitted = cost_fit.load(args.cost) if args.cost else None
    shape, gpus, kv_gb = MODELS[fitted.shape.name if fitted and fitted.shape.name in MODELS else args.model]
    kv_gb = kv_gb if args.kv_gb is None else args.kv_gb
    if not 0 < kv_gb < 1e5:
        raise ValueError(f"--kv-gb: expected GB > 0, got {kv_gb}")
    if fitted is not None:
        return fitted, kv_gb * 1e9 / 2**30
    if args.shape:
        values = _number(args.shape, "--shape")
        if len(values) != 7 or min(values) < 1:
            raise ValueError(f"--shape: expected 7 positive integers, got {args.shape!r}")
        layers, hidden, heads, kv_heads, head_dim, ffn, vocab = values
        shape = ModelShape("custom", layers, hidden, heads, kv_heads, head_dim, ffn, vocab)
    if args.params is not None:
        if not 0 < args.params < 1e5:
            raise ValueError(f"--params: expected billions > 0, got {args.params}")
        shape = dataclasses.replace(shape, stated_params=int(args.params * 1e9))
    gpu = GPUS[args.gpu]
    gpus = gpus if args.gpus is None else args.gpus
    if not 1 <= gpus <= 64:
        raise ValueError(f"--gpus: expected 1..64, got {gpus}")
    bandwidth = gpu.bandwidth if args.bandwidth_tbs is None else args.bandwidth_tbs * 1e12
    flops = gpu.flops if args.tflops is None else args.tflops * 1e12
    if bandwidth <= 0 or flops <= 0:
        raise ValueError("--bandwidth-tbs and --tflops: expected numbers > 0")
    return CostModel(shape, Hardware(gpu.name, bandwidth, flops, gpus)), kv_gb * 1e9 / 2**30


def workload_from_args(args: argparse.Namespace, tiers: tuple[str, ...]) -> Workload:
    rate = DEFAULT_RATE if args.rate is None else args.rate
    if args.trace:
        return Workload.read(args.trace, tiers, args.prefix_tokens)
    shares = {"paid": args.paid_share, "free": 1.0 - args.paid_share}
    if args.burst:
        try:
            peak, on, off = (float(part) for part in args.burst.split(","))
        except ValueError:
            raise ValueError(f"--burst: expected PEAK,ON,OFF, got {args.burst!r}") from None
        times = bursty(rate, peak, on, off, args.duration, args.seed)
    else:
        times = poisson(rate, args.duration, args.seed)
    return Workload.synthetic(
        times,
        shares,
        Lengths.parse(args.prompt),
        Lengths.parse(args.answer),
        turns=args.turns,
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        seed=args.seed,
    )


START_S = 480.0
"""Seconds a simulated 70B replica takes from spawn to ready (weights loaded), by default when
the run scales."""


def main(args: argparse.Namespace) -> int:
    """Run one continuous scenario, print its table, optionally write JSON."""
    try:
        cost, kv_gib = cost_from_args(args)
        if not 0 <= args.gpu_hour_price < 1e6:
            raise ValueError(f"--gpu-hour-price: expected a price >= 0, got {args.gpu_hour_price}")
        budgets = tuple(ms / 1000 for ms in _number(args.wait_budget_ms, "--wait-budget-ms"))
        targets = tuple(ms / 1000 for ms in _number(args.tpot_target_ms, "--tpot-target-ms"))
        queue = QueueConfig(wait_budgets=budgets, tpot_targets=targets)
        replicas = DEFAULT_REPLICAS if args.workers is None else args.workers
        scaled = args.min_workers is not None or args.max_workers is not None
        start_s = (START_S if scaled else 0.0) if args.start_s is None else args.start_s
        model = ContinuousModelConfig(
            name="sim@1",
            simulated="llama-70b",
            workers=replicas,
            kv_memory_gb=kv_gib,
            max_batch_tokens=args.max_batch_tokens,
            max_seqs=args.max_seqs,
            affinity_bound=args.affinity_bound,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            warm_workers=args.warm_workers,
            scale_down_after_s=args.scale_down_after_s,
            idle_after_s=args.idle_after_s,
            start_timeout_ms=max(120_000.0, 2000 * start_s),
        )
        spec = EngineSpec.of(model, cost)
        workload = workload_from_args(args, queue.tiers)
    except (ValueError, OSError) as exc:
        print(f"ferry simulate: {exc}", file=sys.stderr)
        return 2
    print(
        f"ferry simulate --mode continuous: {len(workload):,} requests over {workload.times[-1]:,.0f} s, "
        f"{replicas} replicas of {cost.shape.name} on {cost.hardware.gpus} x {cost.hardware.name} "
        f"({spec.engine.num_blocks:,} KV blocks each)"
    )
    every = args.progress_every
    run = replay(
        workload,
        model,
        queue,
        spec,
        seed=args.seed,
        sample_every=min(every, 1.0),
        progress=None if args.quiet else _every(every),
        jump=not args.step_by_step,
        start_s=start_s,
    )
    report = ContinuousReport.of(run)
    print(report.table())
    if args.gpu_hour_price > 0:
        gpus = cost.hardware.gpus
        print(f"cost: {report.cost_per_million_tokens(args.gpu_hour_price * gpus):,.4f} per million tokens "
              f"({report.tokens:,} tokens answered; {replicas} replicas x {gpus} GPUs at "
              f"{args.gpu_hour_price:g} a GPU-hour)")
    print(f"replica-seconds held: {run.held.sum() * min(every, 1.0):,.0f}")
    print(
        f"simulated {report.virtual_seconds:,.1f} virtual s in {report.cpu_seconds:.2f} CPU s "
        f"({report.requests / max(report.cpu_seconds, 1e-9):,.0f} requests, "
        f"{report.steps / max(report.cpu_seconds, 1e-9):,.0f} engine steps per CPU second)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report.as_dict(), out, indent=2)
    return 0


def _every(seconds: float):
    """A progress callback that prints at most once per ``seconds`` of virtual time."""
    last = [0.0]

    def tell(state: Progress) -> None:
        if state.virtual_seconds - last[0] >= seconds:
            last[0] = state.virtual_seconds
            print_progress(state)

    return tell
