"""Weight-only int8 or int4 against bfloat16 on SmolLM2-135M-Instruct: quality, and the step's time.

    python -m experiments.int8_quality [--weights int8] [--steps 48] [--threads 2] [--rounds 3]

Quality: for each of a fixed set of prompts, the bfloat16 engine answers greedily for
``--steps`` tokens; both runners (bfloat16, and ``--weights``, int8 or int4) are then fed that
same answer one decode step at a time (one row a step: the low-bit side multiplies with its
low-bit matrices), and each step's next-token distributions are compared: greedy agreement (the
share of steps whose most likely token is the same) and the mean KL divergence KL(bf16 || low)
in nats. Speed: decode steps of 1, 2, 4, 8 and 16 sequences on each side, side by side,
``--rounds`` rounds of 6 timed steps, ms min / median
(experiments/docs/engine-int8.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.common import markdown
from workers.convert import ensure_converted
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.runner import ModelRunner
from workers.sampling import Sampling

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "def fibonacci(n):", "List three uses of copper.", "Why do cats purr?",
    "Translate 'good morning' to Spanish.",
    "Summarise the plot of Hamlet in two sentences.", "How does a bicycle stay upright?",
    "Give me a recipe for pancakes.", "What is 17 times 23?", "Describe the smell of rain.",
]
GREEDY = Sample(Sampling(max_tokens=1, temperature=0.0), 0)
BLOCK = 16


def step(runner: ModelRunner, seqs: list[list[int]], new: list[list[int]]) -> torch.Tensor:
    """One step that appends ``new[i]`` to sequence ``i`` (its tokens so far ``seqs[i]``, each
    on blocks ``i * 64 ..``); the logits of each sequence's last token."""
    ids, positions, slots, tables = [], [], [], []
    for i, (seq, tokens) in enumerate(zip(seqs, new, strict=True)):
        table = list(range(i * 64, (i + 1) * 64))
        for offset, token in enumerate(tokens):
            p = len(seq) + offset
            ids.append(token)
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        tables.append(table[: (len(seq) + len(tokens) + BLOCK - 1) // BLOCK])
    contexts = [len(seq) + len(tokens) for seq, tokens in zip(seqs, new, strict=True)]
    batch = ForwardBatch(ids, positions, slots, [len(t) for t in new], contexts, tables, [GREEDY] * len(seqs))
    for seq, tokens in zip(seqs, new, strict=True):
        seq += tokens
    return runner.logits(batch)


def quality(runners: dict[str, ModelRunner], prompts: list[list[int]], steps: int) -> dict:
    low = list(runners)[1]
    agree, kls = [], []
    for prompt in prompts:
        seqs = {name: [list()] for name in runners}
        logits = {name: step(runner, seqs[name], [prompt]) for name, runner in runners.items()}
        for _ in range(steps):
            bf16, lowbit = (torch.log_softmax(logits[name][0], -1) for name in ("bf16", low))
            agree.append(bool(bf16.argmax() == lowbit.argmax()))
            kls.append(float((bf16.exp() * (bf16 - lowbit)).sum()))
            token = int(bf16.argmax())
            logits = {name: step(runner, seqs[name], [[token]]) for name, runner in runners.items()}
    return {"steps compared": len(agree), "greedy agreement": f"{sum(agree) / len(agree):.3f}",
            "mean KL (nats)": f"{statistics.mean(kls):.4f}", "max KL": f"{max(kls):.3f}"}


def speed(runners: dict[str, ModelRunner], prompts: list[list[int]], rounds: int) -> list[dict]:
    low = list(runners)[1]
    rows = []
    for count in (1, 2, 4, 8, 16):
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(rounds):
            for name, runner in runners.items():
                seqs = [[] for _ in range(count)]
                step(runner, seqs, [prompts[i % len(prompts)] for i in range(count)])
                for _ in range(6):
                    started = time.perf_counter()
                    step(runner, seqs, [[7]] * count)
                    times[name].append(time.perf_counter() - started)
        median = {name: statistics.median(spans) for name, spans in times.items()}
        row = {"decodes a step": count}
        for name in runners:
            row[f"{name} ms min / median"] = f"{1e3 * min(times[name]):.1f} / {1e3 * median[name]:.1f}"
        row[f"{low} / bf16 (median)"] = f"{median[low] / median['bf16']:.2f}"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=("int8", "int4"), default="int8", help="the low-bit side")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_converted()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in PROMPTS]
    runners = {
        weights: ModelRunner(model_dir, dtype="bfloat16", device="cpu", num_blocks=64 * 16, weights=weights)
        for weights in ("bf16", args.weights)
    }
    print(markdown([quality(runners, prompts, args.steps)]))
    print(markdown(speed(runners, prompts, args.rounds)))


if __name__ == "__main__":
    main()
