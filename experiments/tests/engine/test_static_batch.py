"""The engine benchmark's two static baselines against the naive full-recompute model. The padded
batch (``experiments/static_batch.py``): a left-padded batch answers each prompt exactly as the
naive model does alone, a row that meets EOS ends while the others go on, and a batch the model
cannot run is refused naming the prompt. The fixed-mode ``generate`` worker's batch, given a
length per row (tests/pure/test_static_generate.py pins its steps).
"""

from __future__ import annotations

import random

import pytest
import torch

from experiments.static_batch import StaticBatcher
from tests.support.oracles import NaiveLlama
from workers.engine.runner import ModelRunner
from workers.models import Generate


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", ["tied", "untied-llama3"])
def test_a_padded_batch_answers_every_prompt_as_the_naive_model_does_alone(tiny_checkpoints, name):
    model_dir = tiny_checkpoints[name]
    batcher = StaticBatcher(model_dir)
    prompts = prompts_of([1, 37, 5, 20, 2, 40], seed=7)  # pads of 0 to 39 tokens
    max_tokens = [9, 3, 14, 1, 6, 11]
    naive = NaiveLlama(model_dir)
    answers = batcher.generate(prompts, max_tokens, ignore_eos=True)
    assert answers == [naive.greedy(p, n) for p, n in zip(prompts, max_tokens, strict=False)]


def test_a_row_ends_at_its_eos_while_the_batch_runs_on_for_the_longest(tiny_checkpoint):
    batcher = StaticBatcher(tiny_checkpoint)
    prompts = prompts_of([12, 30], seed=3)
    naive = NaiveLlama(tiny_checkpoint)
    first, second = naive.greedy(prompts[0], 10), naive.greedy(prompts[1], 10)
    # The tiny model never says its own EOS on these: take a token of the first answer for one.
    eos = next(token for token in first[2:] if token not in second)
    batcher.eos_token_ids = frozenset({eos})
    answers = batcher.generate(prompts, [10, 10])
    assert answers == [first[: first.index(eos) + 1], second]


def test_bfloat16_batches_answer_as_float32_ones_on_clear_cut_weights(tiny_checkpoint):
    prompts = prompts_of([4, 18, 9], seed=5)
    f32 = StaticBatcher(tiny_checkpoint).generate(prompts, [8, 8, 8], ignore_eos=True)
    bf16 = StaticBatcher(tiny_checkpoint, dtype="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.generate(prompts, [8, 8, 8], ignore_eos=True) == f32


@pytest.mark.parametrize(
    ("prompts", "max_tokens", "message"),
    [
        ([[5], []], [3, 3], r"prompts\[1\]: expected 1 or more tokens .* got 0 tokens and max_tokens 3"),
        (
            [[5] * 250],
            [7],
            r"prompts\[0\]: .* within the model's context of 256, got 250 tokens and max_tokens 7",
        ),
        ([[5]], [0], r"prompts\[0\]: .* got 1 tokens and max_tokens 0"),
        ([[5], [6]], [3], r"max_tokens: expected one per prompt \(2\), got 1"),
    ],
)
def test_a_batch_the_model_cannot_run_is_refused_naming_the_prompt(
    tiny_checkpoint, prompts, max_tokens, message
):
    with pytest.raises(ValueError, match=message):
        StaticBatcher(tiny_checkpoint).generate(prompts, max_tokens)


def test_the_generate_worker_s_static_batch_gives_each_row_its_own_length_as_the_naive_model(tiny_checkpoint):
    """``Generate.generate`` (the fixed-mode worker's batch, over the paged runner) with a length
    per row, as the engine benchmark runs it: the batch runs to its longest, each answer is its
    own, and every one equals the naive model's."""
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=64)
    model = Generate(runner, encode=None, decode=None, max_tokens=1, name="tiny")
    prompts = prompts_of([3, 28, 11], seed=9)
    naive = NaiveLlama(tiny_checkpoint)
    answers = model.generate(prompts, [2, 13, 7], ignore_eos=True)
    assert answers == [naive.greedy(p, n) for p, n in zip(prompts, [2, 13, 7], strict=False)]
