"""The decode-attention kernel (workers/engine/cpu/decode_kernel.py) against attention computed in
float32 from the same bfloat16 numbers: strided contexts as the kept copies hold them, padded
past each sequence's length, every head size it takes; clear errors for what it does not take;
and a bfloat16 engine on the CPU that decodes with it still answers as the naive model does."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.oracles import NaiveLlama
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.cpu import decode_kernel
from workers.engine.runner import ModelRunner
from workers.protocol import Sampling

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 here")


@pytest.fixture(scope="module")
def kernel():
    decode_kernel.build()  # make builds it first; quick when up to date
    return decode_kernel.load()


def reference(query, keys, values, lengths, scale):
    mask = torch.full((len(lengths), 1, 1, keys.shape[2]), float("-inf"))
    for s, length in enumerate(lengths.tolist()):
        mask[s, ..., :length] = 0.0
    query, keys, values = query.float(), keys.float(), values.float()
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (16, 2), (128, 1), (32, 7)])
def test_decode_attention_equals_float32_attention_over_each_sequences_own_keys(kernel, head_dim, group):
    generator = torch.Generator().manual_seed(head_dim + group)
    seqs, kv_heads, capacity = 5, 2, 300
    lengths = torch.tensor([1, 17, 250, 299, 64])
    copy = torch.randn(2, seqs, kv_heads, capacity, head_dim, generator=generator).to(torch.bfloat16)
    keys, values = copy[0, :, :, :299], copy[1, :, :, :299]  # strided, as a kept copy's view is
    copy[:, 0, :, 1:] = 1e4  # padding past a length is never read: huge numbers there change nothing
    query = torch.randn(seqs, kv_heads, group, head_dim, generator=generator).to(torch.bfloat16)
    out = kernel(query, keys, values, lengths, 0.125)
    assert out.dtype == torch.float32 and out.shape == (seqs, kv_heads, group, head_dim)
    torch.testing.assert_close(out, reference(query, keys, values, lengths, 0.125), atol=2e-6, rtol=1e-5)


def test_decode_attention_refuses_what_it_does_not_take(kernel):
    query = torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16)
    keys = torch.zeros(2, 1, 10, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 query, keys and values expected"):
        kernel(query.float(), keys.float(), keys.float(), torch.tensor([1, 2]), 1.0)
    with pytest.raises(RuntimeError, match=r"lengths\[1\] = 11 is outside 1 ..10"):
        kernel(query, keys, keys, torch.tensor([1, 11]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64, 128 or 256, got 48"):
        kernel(query[..., :48], keys[..., :48], keys[..., :48], torch.tensor([1, 2]), 1.0)
    with pytest.raises(RuntimeError, match="keys and values must be"):
        kernel(query, keys, keys[:1], torch.tensor([1, 2]), 1.0)


def test_a_bfloat16_engine_decodes_with_the_kernel_and_answers_as_the_naive_model(kernel, tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=64, dtype="bfloat16")
    assert runner.decode is kernel and ModelRunner(tiny_checkpoint, block_size=4, num_blocks=8).decode is None
    rng = random.Random(2)
    prompts = [[rng.randrange(3, runner.config.vocab_size) for _ in range(n)] for n in (9, 30, 3)]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11]]

    def batch(spans):  # each prompt's tokens start..end, its context ending with them
        parts = [(p[start:end], range(start, end)) for p, (start, end) in zip(prompts, spans, strict=True)]
        return ForwardBatch(
            [i for ids, _ in parts for i in ids],
            [p for _, positions in parts for p in positions],
            [t[p // 4] * 4 + p % 4 for (_, span), t in zip(parts, tables, strict=True) for p in span],
            [len(ids) for ids, _ in parts],
            [end for _, end in spans],
            tables,
            [Sample(Sampling(max_tokens=8), 0)] * 3,
        )

    runner.logits(batch([(0, 8), (0, 29), (0, 2)]))  # the prompts but their last tokens
    logits = runner.logits(batch([(8, 9), (29, 30), (2, 3)]))  # then three decodes: the kernel's
    naive = NaiveLlama(tiny_checkpoint)
    for row, prompt in enumerate(prompts):
        expected = naive.logits(prompt)[-1]
        assert logits[row].argmax() == expected.argmax()
        assert (logits[row] - expected).abs().max() < 0.05 * expected.abs().max()
