"""``ferry fit``: time the real engine's steps on this machine, fit the cost model's overhead to
them, and write the file ``ferry simulate --mode continuous --cost FILE`` prices steps with.

The production engine (:class:`~workers.engine.engine.Engine` over the torch
:class:`~workers.engine.runner.ModelRunner`, SmolLM2-135M) runs a designed set of steps in this
process: decodes of each batch size at each context length, mixed steps with a prompt chunk
joining, and each chunk alone. Each step is timed around ``Engine.step()``, in this process's
CPU time with one thread (what a step costs on a core of its own, which other processes on a
shared machine disturb far less than the wall clock), else with the wall clock. The fit is
:func:`workers.engine.fit.cost_fit.fit`, over these steps and those of the files ``--with``
names; this module only measures and writes (docs/simulation-continuous.md, "Step costs").
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from workers.engine.batch import Runner
from workers.engine.config import EngineConfig
from workers.engine.cost_model import SMOLLM2_135M, UNBOUNDED, CostModel, Hardware
from workers.engine.engine import Engine
from workers.engine.fit.cost_fit import Fit, Measured, fit, measured, save
from workers.engine.scheduler import Schedule
from workers.sampling import Sampling

ENDLESS = Sampling(max_tokens=1 << 16, ignore_eos=True)  # greedy, as long as the run needs


@dataclasses.dataclass(frozen=True, slots=True)
class Design:
    """The steps to time (see the module doc)."""

    contexts: tuple[int, ...] = (32, 256, 512)
    batches: tuple[int, ...] = (32, 16, 8, 4, 2, 1)
    chunks: tuple[int, ...] = (16, 64, 128, 256, 512)
    repeats: int = 3
    max_batch_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("contexts", "batches", "chunks"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"--{name}: expected positive integers, got {values}")
        if max(self.chunks) > self.max_batch_tokens or max(self.batches) > self.max_batch_tokens:
            raise ValueError("--chunks and --batches: expected none above --max-batch-tokens")
        if self.repeats < 1:
            raise ValueError(f"--repeats: expected >= 1, got {self.repeats}")


class _Recording:
    """A runner that remembers the lengths of the last step it ran."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.block_size, self.num_blocks = runner.block_size, runner.num_blocks
        self.eos_token_ids, self.max_model_len = runner.eos_token_ids, runner.max_model_len
        self.last: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def run(self, schedule: Schedule) -> list[int | None]:
        contexts = (seq.num_computed + n for seq, n in zip(schedule.seqs, schedule.num_tokens, strict=True))
        self.last = (tuple(schedule.num_tokens), tuple(contexts))
        return self.runner.run(schedule)


def measure(
    runner: Runner, design: Design, vocab: int, clock: Callable[[], float] = time.perf_counter, seed: int = 0
) -> list[Measured]:
    """Every step of the designed run over ``runner`` (see the module doc), prompts of seeded ids
    below ``vocab``, timed by ``clock``."""
    recording = _Recording(runner)
    rng = random.Random(seed)
    records: list[Measured] = []

    def engine() -> Engine:
        config = EngineConfig(
            block_size=runner.block_size,
            num_blocks=runner.num_blocks,
            max_batch_tokens=design.max_batch_tokens,
            max_seqs=max(design.batches) + 1,
        )
        return Engine(recording, config)

    def add(into: Engine, tokens: int) -> int:
        return into.add([rng.randrange(3, vocab) for _ in range(tokens)], ENDLESS)

    def step(into: Engine) -> None:
        recording.last = None
        start = clock()
        into.step()
        seconds = clock() - start
        if recording.last is not None:
            records.append(Measured(*recording.last, seconds))

    warm = engine()  # the first steps of a process pay for its kernels' set-up
    add(warm, min(design.chunks))
    for _ in range(3):
        warm.step()
    chunks = itertools.cycle(design.chunks)
    for context in design.contexts:
        current = engine()
        low, high = context - context // 2, context + context // 2
        rids = [add(current, rng.randint(low, high)) for _ in range(max(design.batches))]
        sequences = current.scheduler.sequences
        while any(seq.num_computed < seq.num_prompt for seq in sequences.values()):
            step(current)
        for batch in sorted(design.batches, reverse=True):
            for rid in rids[batch:]:
                current.abort(rid)
            rids = rids[:batch]
            for _ in range(design.repeats):
                step(current)
            joining = add(current, next(chunks))
            step(current)
            current.abort(joining)
    alone = engine()
    for chunk in design.chunks:
        rid = add(alone, chunk)
        step(alone)
        alone.abort(rid)
    return records


def fitted_cost(result: Fit, dtype: str) -> CostModel:
    """SmolLM2-135M's shape in ``dtype``, priced by the fitted overhead alone."""
    width = 4 if dtype == "float32" else 2
    shape = dataclasses.replace(SMOLLM2_135M, bytes_per_param=width, bytes_per_kv=width)
    roofline = Hardware("this CPU (fitted)", UNBOUNDED.bandwidth, UNBOUNDED.flops)
    return CostModel(shape, roofline, result.overhead)


def _numbers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Design()
    parser.add_argument("--out", default="costs.json", help="the file to write (default costs.json)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--contexts", type=_numbers, default=defaults.contexts, metavar="N,N,...")
    parser.add_argument("--batches", type=_numbers, default=defaults.batches, metavar="N,N,...")
    parser.add_argument("--chunks", type=_numbers, default=defaults.chunks, metavar="N,N,...")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="decode steps per batch size")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    parser.add_argument("--wall", action="store_true", help="time steps on the wall clock, not in CPU time")
    parser.add_argument(
        "--with", dest="earlier", action="append", default=[], metavar="FILE",
        help="fit these steps together with those an earlier ferry fit measured (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    """Measure the real engine's steps on this machine and write fitted step costs."""
    try:
        design = Design(args.contexts, args.batches, args.chunks, args.repeats, args.max_batch_tokens)
        if args.threads < 1:
            raise ValueError(f"--threads: expected >= 1, got {args.threads}")
    except ValueError as exc:
        print(f"ferry fit: {exc}", file=sys.stderr)
        return 2
    import torch  # only a measurement needs it

    from workers.convert import ensure_converted
    from workers.engine.runner import ModelRunner

    torch.set_num_threads(args.threads)
    model_dir = ensure_converted("smollm2-135m", log=lambda line: print(line, file=sys.stderr))
    runner = ModelRunner(model_dir, dtype=args.dtype)
    started = time.perf_counter()
    wall = args.wall or args.threads > 1
    clock = time.perf_counter if wall else time.process_time
    records = measure(runner, design, runner.config.vocab_size, clock)
    timed = len(records)
    try:
        for path in args.earlier:
            records += measured(path)
        result = fit(records)
    except (ValueError, OSError) as exc:
        print(f"ferry fit: {exc}", file=sys.stderr)
        return 2
    about: dict[str, Any] = {
        "engine": f"SmolLM2-135M-Instruct, {args.dtype}, {args.threads} torch thread(s)",
        "clock": "wall" if wall else "process CPU time",
        "design": dataclasses.asdict(design),
        "steps": result.steps,
        "median_error": result.median_error,
        "worst_error": result.worst_error,
        "measured": [[list(r.query_lens), list(r.context_lens), r.seconds] for r in records],
    }
    save(args.out, fitted_cost(result, args.dtype), about)
    print(table(result, records))
    earlier = f", fitted with {len(records) - timed} from {', '.join(args.earlier)}" if args.earlier else ""
    print(f"{timed} steps timed in {time.perf_counter() - started:.0f} s{earlier}; wrote {args.out}")
    return 0


def table(result: Fit, records: Iterable[Measured]) -> str:
    """The fitted constants, and the fit's error by kind of step."""
    overhead = result.overhead
    lines = [
        f"per step {overhead.step * 1e3:.3f} ms, per sequence {overhead.seq * 1e3:.4f} ms, "
        f"per token {overhead.token * 1e3:.4f} ms, per context token {overhead.context * 1e6:.3f} us, "
        f"per attention pair {overhead.pair * 1e9:.3f} ns",
        f"relative error over {result.steps} steps: median {result.median_error:.1%}, "
        f"worst {result.worst_error:.1%}",
    ]
    kinds: dict[str, list[float]] = {}
    for record in records:
        decodes = sum(q == 1 for q in record.query_lens)
        kind = "decode" if decodes == len(record.query_lens) else "prefill" if not decodes else "mixed"
        predicted = overhead.seconds(*record.counts()[1:])
        kinds.setdefault(kind, []).append(predicted / record.seconds - 1)
    for kind, errors in sorted(kinds.items()):
        mean = sum(errors) / len(errors)
        lines.append(f"  {kind}: {len(errors)} steps, predicted / measured - 1: mean {mean:+.1%}")
    return "\n".join(lines)
