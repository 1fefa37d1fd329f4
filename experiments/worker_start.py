"""How long a fixed-mode worker takes from spawn to its ``ready`` frame, for one or more source
trees, with and without their modules compiled ahead, side by side.

    python -m experiments.worker_start [--trees . /tmp/before] [--rounds 10] [--starts 5]

A fleet whose every worker crashed or broke the protocol at once serves nothing until one is
back, so this start-up is part of every such request's wait. Each tree (a checkout of ferry:
``git worktree add /tmp/before HEAD~1`` gives an earlier one) runs ``python -m workers sleep``
from its own directory, in two states: ``source`` (its ``__pycache__`` folders removed, with
``PYTHONDONTWRITEBYTECODE=1``, as in a container that sets it: every start compiles ferry's
modules again) and ``compiled`` (``compileall`` first, as ``make test`` and ``make serve`` do).
Each round runs ``--starts`` starts of every tree in every state, in turn, so that a machine
that gets busier slows all of them alike. Reported: milliseconds from spawn to the first byte
of the ``ready`` frame, min and median over all rounds.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import markdown

PACKAGES = ("batcher", "gateway", "workers")
STATES = ("source", "compiled")


def set_state(tree: Path, state: str) -> None:
    """Remove the tree's cached bytecode of ferry's packages, or compile it."""
    for package in PACKAGES:
        if state == "compiled":
            compileall.compile_dir(str(tree / package), quiet=1)
        else:
            for cache in (tree / package).rglob("__pycache__"):
                shutil.rmtree(cache)


def start_ms(tree: Path) -> float:
    """Milliseconds from spawning a ``sleep`` worker in ``tree`` to the first byte it sends."""
    environment = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    began = time.perf_counter()
    worker = subprocess.Popen([sys.executable, "-m", "workers", "sleep"], cwd=tree, env=environment,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    first = worker.stdout.read(1)  # type: ignore[union-attr]
    elapsed = (time.perf_counter() - began) * 1000
    worker.stdin.close()  # type: ignore[union-attr]
    worker.wait(10)
    if not first:
        raise RuntimeError(f"the worker in {tree} exited before it was ready ({worker.returncode})")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")], help="ferry checkouts")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--starts", type=int, default=5, help="starts of each tree and state a round")
    args = parser.parse_args(argv)
    times: dict[tuple[Path, str], list[float]] = {
        (tree, state): [] for tree in args.trees for state in STATES
    }
    for _ in range(args.rounds):
        for tree in args.trees:
            for state in STATES:
                set_state(tree, state)
                times[tree, state] += [start_ms(tree) for _ in range(args.starts)]
    for tree in args.trees:
        set_state(tree, "compiled")
    print(markdown([{"tree": str(tree), "bytecode": state, "min ms": round(min(ms)),
                     "median ms": round(statistics.median(ms)), "starts": len(ms)}
                    for (tree, state), ms in times.items()]))


if __name__ == "__main__":
    main()
