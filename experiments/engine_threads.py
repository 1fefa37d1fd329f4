"""One engine's decode step with 1 torch thread against more, alternating in one process.

    python -m experiments.engine_threads [--threads 1 2] [--seqs 32] [--rounds 8] [--steps 3]

This tree's engine takes ``--seqs`` seeded prompts of 200-340 tokens (bfloat16) and prefills
them with one thread; then, each round, each thread count in turn runs one untimed and
``--steps`` timed decode steps of all ``--seqs`` sequences (``torch.set_num_threads`` between
them). Reported: wall milliseconds a step, min and median, and each count's over the first's.
Wall time, not CPU time: more threads spend more CPU to finish sooner.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from experiments.common import markdown
from experiments.engine_step import decoding_engine
from workers.convert import ensure_converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = ensure_converted(log=lambda line: print(line, file=sys.stderr))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40_000) for _ in range(rng.randint(200, 340))] for _ in range(args.seqs)]
    engine = decoding_engine("workers", model_dir, "bfloat16", prompts)
    wall: dict[int, list[float]] = {threads: [] for threads in args.threads}
    for _ in range(args.rounds):
        for threads in args.threads:
            torch.set_num_threads(threads)
            engine.step()
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step()
                wall[threads].append(time.perf_counter() - started)
    first = statistics.median(wall[args.threads[0]])
    print(f"{args.seqs} decodes a step, bfloat16", file=sys.stderr)
    print(markdown([
        {
            "threads": threads,
            "wall ms min": 1e3 * min(seconds),
            "wall ms median": 1e3 * statistics.median(seconds),
            "median / first's": f"{statistics.median(seconds) / first:.2f}",
        }
        for threads, seconds in wall.items()
    ]))


if __name__ == "__main__":
    main()
