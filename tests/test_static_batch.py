"""Static batching (``workers/engine/static.py``) and the ``llm`` fixed-mode worker built on it:
a left-padded batch answers each prompt exactly as the naive full-recompute model does alone, a
row that meets EOS ends while the others go on, and ``python -m workers llm`` behind the real
pool answers texts batched together, an input it cannot run failing alone.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import trio

from batcher.config import PoolConfig
from batcher.fixed import open_batcher
from batcher.policy import SizeOrTimeout
from batcher.process_worker import ProcessWorker
from batcher.types import RequestFailed
from tests.oracles import NaiveLlama
from workers.engine.static import StaticBatcher


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
    assert answers == [naive.greedy(p, n) for p, n in zip(prompts, max_tokens)]


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


async def test_the_llm_worker_answers_a_batch_of_texts_and_fails_a_bad_input_alone(tiny_checkpoint):
    from tokenizers import Tokenizer

    argv = ["llm", "--model", str(tiny_checkpoint), "--max-new-tokens", "6"]
    spawned: list[ProcessWorker] = []

    def spawn(slot: int) -> ProcessWorker:
        spawned.append(ProcessWorker(argv, dict(os.environ)))
        return spawned[-1]

    texts = ["A ferry crosses the river", "Tickets cost 3 coins", "What is the capital of France?", ""]
    config = PoolConfig(workers=1, hang_timeout=60.0)
    results: dict[str, str | Exception] = {}
    async with open_batcher(spawn, config, SizeOrTimeout(8, 0.2)) as batcher:

        async def one(text: str) -> None:
            try:
                results[text] = await batcher.answer(text, "paid")
            except RequestFailed as exc:
                results[text] = exc

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for text in texts:
                    nursery.start_soon(one, text)
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    naive = NaiveLlama(tiny_checkpoint)
    for text in texts[:3]:
        assert results[text] == tokenizer.decode(naive.greedy(tokenizer.encode(text).ids, 6)), text
    # The pool bisected the batch to the empty input; the client hears no model detail.
    assert str(results[""]) == "the input failed on 3 attempts; last: the model raised ValueError"
    assert batcher.stats.restarts == 0 and [w.model for w in spawned] == ["llm-tied"]
