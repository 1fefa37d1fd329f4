"""The continuous engine against static batching, no batching and transformers' continuous
batching, side by side on one workload, on SmolLM2-135M on this CPU.

    python -m experiments.engine_bench [--requests 32] [--dtype float32] [--static-batch 8 16]
        [--solo 2] [--max-batch-tokens 512] [--max-seqs 64]
        [--systems engine generate padded solo transformers]

The workload (``--seed``): ``--requests`` prompts of 20-500 random tokens, each asking for
10-300 answer tokens, every one generated (EOS ignored, so every system does the same work), all
arriving at once. Each system answers greedily in this process, with ``--threads`` torch threads
(1 by default), and is timed from the first request to the last token after a warm-up of its
own; the engine runs first and again last, its row the mean of both. The systems (``engine``,
``generate B``: the fixed-mode worker's static batches over the same paged runner, ``padded B``:
:class:`experiments.static_batch.StaticBatcher`, ``solo``, ``transformers``), KV utilisation as
measured here, and the figures: experiments/docs/engine.md. Every system's answers are checked
against the engine's token for token (float32 only: bfloat16 sums in another order drift).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Callable

import torch

from experiments.common import markdown
from experiments.static_batch import StaticBatcher
from workers.convert import ensure_converted
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.runner import ModelRunner
from workers.models import Generate
from workers.sampling import Sampling

BLOCK = 16  # tokens a KV block holds (the runner's default)


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    answer: int  # tokens to generate


@dataclasses.dataclass
class Outcome:
    system: str
    requests: int
    generated: int
    seconds: float
    kv_utilisation: float = float("nan")
    answers: list[list[int]] | None = None
    note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds


def workload(count: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.randrange(3, vocab) for _ in range(rng.randint(20, 500))], rng.randint(10, 300))
        for _ in range(count)
    ]


def run_engine(runner: ModelRunner, requests: list[Request], max_batch_tokens: int, max_seqs: int) -> Outcome:
    config = EngineConfig(runner.block_size, runner.num_blocks, max_batch_tokens, max_seqs)
    engine = Engine(runner, config)
    answers: dict[int, list[int]] = {}
    utilisation: list[float] = []
    started = time.perf_counter()
    for request in requests:
        rid = engine.add(request.prompt, Sampling(max_tokens=request.answer, ignore_eos=True))
        answers[rid] = []
    while engine.has_work:
        for rid, token in engine.step().tokens.items():
            answers[rid].append(token)
        running = engine.scheduler.running
        if running:
            held = sum(seq.num_computed for seq in running)
            utilisation.append(held / (engine.scheduler.blocks.num_used * runner.block_size))
    seconds = time.perf_counter() - started
    stats = engine.stats()
    return Outcome(
        f"engine (budget {max_batch_tokens}, max_seqs {max_seqs})",
        len(requests),
        stats.generated_tokens,
        seconds,
        sum(utilisation) / len(utilisation),
        [answers[rid] for rid in range(len(requests))],
        f"{stats.step} steps, {stats.generated_tokens / stats.step:.1f} tokens a step, "
        f"{stats.preemptions} preemptions",
    )


def run_static(generate: Callable, requests: list[Request], size: int, name: str, padded: bool) -> Outcome:
    """Batches of ``size`` through ``generate(prompts, max_tokens, ignore_eos=True)``."""
    answers: list[list[int]] = []
    utilisation: list[float] = []
    started = time.perf_counter()
    for first in range(0, len(requests), size):
        batch = requests[first : first + size]
        answers += generate([r.prompt for r in batch], [r.answer for r in batch], ignore_eos=True)
        width, steps = max(len(r.prompt) for r in batch), max(r.answer for r in batch)
        for step in range(steps):  # once step `step` has run: the prefill, then `step` decodes
            held = sum(len(r.prompt) + min(step, r.answer - 1) for r in batch)
            if padded:
                reserved = len(batch) * (width + steps - 1)
            else:
                reserved = sum(-(-(len(r.prompt) + step) // BLOCK) * BLOCK for r in batch)
            utilisation.append(held / reserved)
    seconds = time.perf_counter() - started
    generated = sum(len(answer) for answer in answers)
    return Outcome(name, len(requests), generated, seconds, sum(utilisation) / len(utilisation), answers)


def run_transformers(
    model_dir, dtype: str, requests: list[Request], cache_tokens: int, max_batch_tokens: int, page_size: int
) -> Outcome:
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=300)
    config = ContinuousBatchingConfig(
        num_blocks=cache_tokens // page_size,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=False,  # no prompt shares a prefix here
    )
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=config, block=True, timeout=5
    ) as manager:
        warm = manager.add_request(requests[0].prompt[:32], max_new_tokens=4)
        while not (result := manager.get_result(warm, timeout=60)) or not result.is_finished():
            pass
        started = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.answer) for r in requests]
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching stalled for 60 s")
            if result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
        seconds = time.perf_counter() - started
    answers = [done[rid] for rid in ids]
    return Outcome(
        "transformers continuous batching", len(requests), sum(map(len, answers)), seconds, answers=answers
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--static-batch", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--solo", type=int, default=2, help="requests for the one-at-a-time system")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument(
        "--kv-memory-gb", type=float, default=1.0, help="the engine's (and transformers') KV cache"
    )
    parser.add_argument(
        "--hf-page-size", type=int, default=256, help="transformers' page, in tokens (its default, 256)"
    )
    parser.add_argument(
        "--systems", nargs="+", default=["engine", "generate", "padded", "solo", "transformers"]
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: see the module's docstring)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = ensure_converted(log=lambda line: print(line, file=sys.stderr))
    runner = ModelRunner(model_dir, block_size=BLOCK, kv_memory_gb=args.kv_memory_gb, dtype=args.dtype)
    requests = workload(args.requests, args.seed, runner.config.vocab_size)
    print(
        f"{len(requests)} requests: prompts {sum(len(r.prompt) for r in requests):,} tokens, "
        f"answers {sum(r.answer for r in requests):,}; {args.dtype}; "
        f"KV cache {runner.num_blocks} blocks of {runner.block_size}",
        file=sys.stderr,
    )
    warm_up = Request(requests[0].prompt[:32], 4)  # each system's first call pays its kernels' set-up
    outcomes: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        print(
            f"  {outcome.system}: {outcome.tokens_per_second:.1f} tok/s {outcome.note}",
            file=sys.stderr,
            flush=True,
        )
        outcomes.append(outcome)

    def checked(outcome: Outcome) -> None:
        if engine and args.dtype == "float32":
            ours = engine.answers[: outcome.requests]
            same = sum(a == b for a, b in zip(ours, outcome.answers, strict=False))
            outcome.note = f"{same}/{outcome.requests} as the engine"
        report(outcome)

    engine = None
    if "engine" in args.systems:
        run_engine(runner, [warm_up], args.max_batch_tokens, args.max_seqs)
        engine = run_engine(runner, requests, args.max_batch_tokens, args.max_seqs)
        report(engine)
    sizes = args.static_batch
    static = Generate(runner, encode=None, decode=None, max_tokens=1, name="generate")
    if "generate" in args.systems or "solo" in args.systems:
        static.generate([warm_up.prompt], [warm_up.answer])
    for size in sizes if "generate" in args.systems else []:
        checked(run_static(static.generate, requests, size, f"generate, batches of {size}", padded=False))
    if "padded" in args.systems:
        batcher = StaticBatcher(model_dir, dtype=args.dtype)
        batcher.generate([warm_up.prompt], [warm_up.answer])
        for size in sizes:
            checked(run_static(batcher.generate, requests, size, f"padded, batches of {size}", padded=True))
    if "solo" in args.systems:
        solo = requests[: args.solo]
        checked(run_static(static.generate, solo, 1, f"no batching (first {args.solo})", padded=False))
    if "transformers" in args.systems:
        cache_tokens = runner.num_blocks * runner.block_size
        outcome = run_transformers(
            model_dir, args.dtype, requests, cache_tokens, args.max_batch_tokens, args.hf_page_size
        )
        checked(outcome)
    if engine and len(outcomes) > 1:
        # Run again last, so that a machine that got busier or quieter during the run weighs on
        # the engine as on the others: its row has their mean time.
        again = run_engine(runner, requests, args.max_batch_tokens, args.max_seqs)
        assert again.answers == engine.answers
        first = engine.tokens_per_second
        engine.seconds = (engine.seconds + again.seconds) / 2
        engine.kv_utilisation = (engine.kv_utilisation + again.kv_utilisation) / 2
        engine.note += f"; first and last {first:.1f} and {again.tokens_per_second:.1f} tok/s"
    print(markdown([row(outcome, engine) for outcome in outcomes]))


def row(outcome: Outcome, engine: Outcome | None) -> dict:
    return {
        "system": outcome.system,
        "requests": outcome.requests,
        "tokens generated": outcome.generated,
        "seconds": outcome.seconds,
        "tok/s": outcome.tokens_per_second,
        "engine / this": engine.tokens_per_second / outcome.tokens_per_second if engine else float("nan"),
        "KV utilisation": "—" if math.isnan(outcome.kv_utilisation) else f"{outcome.kv_utilisation:.0%}",
        "note": outcome.note,
    }


if __name__ == "__main__":
    main()
