"""One batched decode step of the engine, this tree against an earlier commit, side by side.

    python -m experiments.engine_step [--before main] [--seqs 32] [--dtype bfloat16]
        [--threads 1] [--rounds 8] [--steps 4] [--churn 0] [--prefill 0] [--profile]

The engine of ``--before`` (a git ref; its ``workers`` package is unpacked into a temporary
directory under another name) and this tree's each load SmolLM2-135M and take the same
``--seqs`` seeded prompts of 200-340 tokens (answers long enough never to end), prefill them,
then take turns: each round, each side runs one untimed step and ``--steps`` timed decode
steps of all ``--seqs`` sequences. Reported per side: wall and CPU seconds per step (CPU:
this thread's, which a loaded machine's other processes disturb less than the wall clock),
min and median, and this tree's over the earlier one's. ``--churn N``: before each timed step,
each side aborts its ``N`` oldest sequences and adds ``N`` new random prompts of 20-60 tokens
(the same on both sides), so that every step prefills some and the batch's decodes change, as
a busy server's do. ``--prefill N``: each timed step is instead the first step of a burst of
new prompts of 64-600 tokens, ``N`` tokens in all (the same on both sides; every step of the
burst after the timed one runs untimed, so the next burst starts on an empty batch), and the
table adds that step's page faults (the kernel's count for this process). ``--profile`` then
prints torch.profiler's table of each side's steps, by operator.
"""

from __future__ import annotations

import argparse
import importlib
import io
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from experiments.common import markdown
from workers.convert import ensure_converted

BEFORE = "before_workers"


def unpack(ref: str, into: Path) -> None:
    """``ref``'s ``workers`` package, as package :data:`BEFORE` under ``into``, beside this tree's
    ``build/`` (each side's C++ kernels are built there, under names of their own sources)."""
    (into / "build").symlink_to(Path(__file__).resolve().parents[1] / "build", target_is_directory=True)
    archive = subprocess.run(["git", "archive", ref, "workers"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith((".py", ".cpp", ".h")):
                text = tar.extractfile(member).read().decode()
                path = into / BEFORE / member.name.removeprefix("workers/")
                path.parent.mkdir(parents=True, exist_ok=True)
                renamed = text.replace("workers.", BEFORE + ".").replace("from workers ", f"from {BEFORE} ")
                path.write_text(renamed if member.name.endswith(".py") else text)


def build_kernels(package: str) -> None:
    """Build ``package``'s C++ kernels as ``make kernels`` does, whichever module an earlier
    commit had for it (``kernels``, or ``decode_kernel`` before there were several)."""
    for name, call in (("kernels", "main"), ("decode_kernel", "build")):
        try:
            module = importlib.import_module(f"{package}.engine.cpu.{name}")
        except ModuleNotFoundError:
            continue
        getattr(module, call)()
        return


def sampling(package: str, **fields):
    """``fields`` as ``package``'s sampling: ``protocol.Sampling``, or before there was one
    (an earlier commit's copy) ``engine.sequence.SamplingParams``."""
    kind = getattr(importlib.import_module(f"{package}.protocol"), "Sampling", None)
    return (kind or importlib.import_module(f"{package}.engine.sequence").SamplingParams)(**fields)


def decoding_engine(package: str, model_dir: Path, dtype: str, prompts: list[list[int]]):
    """An engine of ``package`` (``workers`` or :data:`BEFORE`) holding ``prompts``, prefilled."""
    module: dict[str, ModuleType] = {
        name: importlib.import_module(f"{package}.engine.{name}")
        for name in ("runner", "engine", "config", "sequence")
    }
    runner = module["runner"].ModelRunner(model_dir, kv_memory_gb=0.3, dtype=dtype)
    config = module["config"].EngineConfig(runner.block_size, runner.num_blocks, 4096, len(prompts))
    engine = module["engine"].Engine(runner, config)
    for prompt in prompts:
        engine.add(prompt, sampling(package, max_tokens=4000, ignore_eos=True))
    while engine.scheduler.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="main", help="the git ref to compare with")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side and round")
    parser.add_argument("--churn", type=int, default=0, help="sequences replaced before each timed step")
    parser.add_argument("--prefill", type=int, default=0, help="time a burst's first step of N tokens")
    parser.add_argument("--profile", action="store_true", help="then profile this tree's steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_converted(log=lambda line: print(line, file=sys.stderr))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40_000) for _ in range(rng.randint(200, 340))] for _ in range(args.seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        unpack(args.before, Path(tmp))
        sys.path.insert(0, tmp)
        for package in (BEFORE, "workers"):
            build_kernels(package)
        engines = {
            args.before: decoding_engine(BEFORE, model_dir, args.dtype, prompts),
            "this tree": decoding_engine("workers", model_dir, args.dtype, prompts),
        }
        wall: dict[str, list[float]] = {name: [] for name in engines}
        cpu: dict[str, list[float]] = {name: [] for name in engines}
        faults: dict[str, list[float]] = {name: [] for name in engines}
        newcomers = random.Random(1)
        if args.prefill:
            for engine in engines.values():
                replace(engine, [], everyone=True)
        for _ in range(args.rounds):
            arrivals = [
                [newcomers.randrange(3, 40_000) for _ in range(newcomers.randint(20, 60))]
                for _ in range(args.churn * args.steps)
            ]
            bursts = [burst(newcomers, args.prefill) for _ in range(args.steps if args.prefill else 0)]
            for name, engine in engines.items():
                if not args.prefill:  # one untimed decode step (a burst's is its own warm-up)
                    engine.step()
                for step in range(args.steps):
                    if args.prefill:
                        replace(engine, bursts[step], everyone=True)
                    else:
                        replace(engine, arrivals[step * args.churn : (step + 1) * args.churn])
                    started, started_cpu = time.perf_counter(), time.thread_time()
                    paged_in = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    engine.step()
                    cpu[name].append(time.thread_time() - started_cpu)
                    wall[name].append(time.perf_counter() - started)
                    faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - paged_in)
                    while args.prefill and engine.has_work:
                        engine.step()
    rows = [
        {
            "engine": name,
            "wall ms min": 1e3 * min(wall[name]),
            "wall ms median": 1e3 * statistics.median(wall[name]),
            "CPU ms min": 1e3 * min(cpu[name]),
            "CPU ms median": 1e3 * statistics.median(cpu[name]),
            **({"page faults median": statistics.median(faults[name])} if args.prefill else {}),
        }
        for name in engines
    ]
    before, after = rows
    ratios = {key: after[key] / before[key] if before[key] else None for key in after if key != "engine"}
    rows.append({key: "-" if ratio is None else f"{ratio:.2f}" for key, ratio in ratios.items()})
    rows[-1]["engine"] = "this / before"
    what = f"a first step of {args.prefill} prompt tokens" if args.prefill else f"{args.seqs} decodes a step"
    print(f"{what}, {args.dtype}, {args.threads} thread(s)", file=sys.stderr)
    print(markdown(rows))
    for name, engine in engines.items() if args.profile else ():
        print(f"{name}, 5 steps:")
        print(profile(engine, 5))


def burst(rng: random.Random, tokens: int) -> list[list[int]]:
    """New prompts of 64-600 tokens, ``tokens`` in all."""
    prompts: list[list[int]] = []
    while (left := tokens - sum(map(len, prompts))) > 0:
        prompts.append([rng.randrange(3, 40_000) for _ in range(min(left, rng.randint(64, 600)))])
    return prompts


def replace(engine, prompts: list[list[int]], everyone: bool = False) -> None:
    """Abort ``engine``'s oldest running sequences, one for each of ``prompts`` (or all of them),
    and add those, each to be answered at length (or, with ``everyone``, with one token)."""
    running = sorted(seq.rid for seq in engine.scheduler.running)
    for rid in running if everyone else running[: len(prompts)]:
        engine.abort(rid)
    package = type(engine).__module__.partition(".")[0]  # workers or its earlier copy
    for prompt in prompts:
        engine.add(prompt, sampling(package, max_tokens=1 if everyone else 4000, ignore_eos=True))


def profile(engine, steps: int) -> str:
    """torch.profiler's table of ``steps`` steps of ``engine``, by operator, busiest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


if __name__ == "__main__":
    main()
