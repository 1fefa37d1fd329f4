"""The paged model against two oracles, on tiny random checkpoints, in float32: a naive
full-recompute forward of the same weights (tests/naive_llama.py) and transformers'
``LlamaForCausalLM.generate``. Batches come from tests/paged_driver.py: staggered arrivals,
uneven prefill chunks beside decodes, blocks reused right after another sequence freed them.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.naive_llama import NaiveLlama
from tests.paged_driver import PagedDriver, Request
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.checkpoint import ModelConfig, Rope, read_rope
from workers.engine.runner import ModelRunner
from workers.engine.sequence import SamplingParams
from workers.engine.tiny_checkpoint import CHAT_TEMPLATE

GREEDY = SamplingParams(max_tokens=64)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def transformers_greedy(model_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run every sequence to its length, EOS or not
    answers = []
    for prompt, n in zip(prompts, max_tokens):
        config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = model.generate(torch.tensor([prompt]), generation_config=config)
        answers.append(out[0, len(prompt) :].tolist())
    return answers


def mixed_requests(vocab: int, count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 20),
            arrival=rng.randint(0, 25),
            params=GREEDY,
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("name", ["tied", "untied-llama3", "tied-linear"])
def test_interleaved_greedy_equals_naive_and_transformers(tiny_checkpoints, name):
    model_dir = tiny_checkpoints[name]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=48)
    requests = sorted(mixed_requests(runner.config.vocab_size, 14, seed=len(name)), key=lambda r: r.arrival)
    driver = PagedDriver(runner, seed=3)
    paged = driver.run(requests)
    assert driver.mixed_steps >= 5 and driver.reused_blocks >= 20  # the workload did interleave and reuse
    naive = NaiveLlama(model_dir)
    assert paged == [naive.greedy(r.prompt, r.max_tokens) for r in requests]
    assert paged == transformers_greedy(model_dir, [r.prompt for r in requests], [r.max_tokens for r in requests])


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_logits_equal_naive(tiny_checkpoints, device):
    """One batch: a decode, a first prefill chunk, a middle one and a last one, out of order
    in their blocks; every sampled row's logits are the naive model's at that position."""
    model_dir = tiny_checkpoints["untied-llama3"]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=32, device=device)
    runner.kv_cache.normal_(0.0, 3.0)
    rng = random.Random(5)
    a, b, c = ([rng.randrange(3, runner.config.vocab_size) for _ in range(n)] for n in (11, 9, 14))
    tables = {"a": [9, 2, 30], "b": [5, 17, 0], "c": [31, 1, 8, 12]}

    def entries(name, tokens, start, end, sample):
        table = tables[name]
        return {
            "ids": tokens[start:end],
            "positions": list(range(start, end)),
            "slots": [table[p // 4] * 4 + p % 4 for p in range(start, end)],
            "query_len": end - start,
            "context_len": end,
            "table": table,
            "sample": Sample(GREEDY, 0) if sample else None,
        }

    def run(parts):
        batch = ForwardBatch(
            [i for p in parts for i in p["ids"]],
            [i for p in parts for i in p["positions"]],
            [i for p in parts for i in p["slots"]],
            [p["query_len"] for p in parts],
            [p["context_len"] for p in parts],
            [p["table"] for p in parts],
            [p["sample"] for p in parts],
        )
        return runner.logits(batch).cpu()

    run([entries("a", a, 0, 10, False), entries("c", c, 0, 5, False)])
    logits = run([entries("c", c, 5, 9, False), entries("a", a, 10, 11, True), entries("b", b, 0, 9, True)])
    naive = NaiveLlama(model_dir)
    torch.testing.assert_close(logits[0], naive.logits(a)[10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], naive.logits(b)[8], atol=1e-4, rtol=1e-4)
    logits = run([entries("c", c, 9, 14, True)])
    torch.testing.assert_close(logits[0], naive.logits(c)[13], atol=1e-4, rtol=1e-4)
