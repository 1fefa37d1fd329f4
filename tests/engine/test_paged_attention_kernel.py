"""The paged-attention kernel (workers/engine/cpu/csrc/paged_attention.cpp) of every build this
CPU runs, against attention computed in float64 from the same numbers: one call over a step
that holds decodes at both sides of a block boundary, a one-token prompt, a chunk after a
cached prefix and a whole prompt longer than a task's tile, for several head sizes, groups and
block sizes, in bfloat16 and float32, with and without RoPE; the cache it leaves is the one the
step writes; and what it refuses, it refuses by name."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.cpu import kernels

BUILDS = [capability for capability in kernels.runnable() if kernels.load(capability) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no kernel build runs here (make kernels)")


def rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the model's Rotary lays them out (sin's first half negated)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def reference(qkv, cos, sin, positions, slots, cache, starts, tables, heads, scale):
    """The cache after the step's writes, and each token's attention over its sequence's keys
    0 .. its position, in float64."""
    _, kv_heads, blocks, block_size, dim = cache.shape
    group = heads // kv_heads
    x = qkv.double().view(len(positions), heads + 2 * kv_heads, dim)
    if cos.numel():
        c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
        qk = x[:, : heads + kv_heads]
        x = torch.cat((qk * c + qk.roll(dim // 2, -1) * s, x[:, heads + kv_heads :]), dim=1)
    cache = cache.clone()
    flat = cache.view(2, kv_heads, blocks * block_size, dim)
    flat[0][:, slots] = x[:, heads : heads + kv_heads].transpose(0, 1).to(cache.dtype)
    flat[1][:, slots] = x[:, heads + kv_heads :].transpose(0, 1).to(cache.dtype)
    out = torch.zeros(len(positions), heads, dim, dtype=torch.float64)
    for seq in range(len(starts) - 1):
        for t in range(int(starts[seq]), int(starts[seq + 1])):
            seen = torch.arange(int(positions[t]) + 1)
            where = tables[seq][seen // block_size].long() * block_size + seen % block_size
            keys, values = flat[0][:, where].double(), flat[1][:, where].double()
            for h in range(heads):
                weights = torch.softmax(x[t, h] @ keys[h // group].T * scale, dim=0)
                out[t, h] = weights @ values[h // group]
    return cache, out.view(len(positions), heads * dim)


def step(dim: int, group: int, block_size: int, dtype: torch.dtype, seed: int):
    """One step's inputs: (name, prefix already cached, tokens this step) per sequence, each on
    blocks drawn at random from the cache, whose cached prefixes hold random numbers."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    kv_heads = 2
    heads = kv_heads * group
    sequences = [
        ("decode ending a block", 2 * block_size - 1, 1),
        ("decode starting a block", 2 * block_size, 1),
        ("one-token prompt", 0, 1),
        ("chunk after a cached prefix", 3 * block_size + 1, 23),
        ("whole prompt of many tiles", 0, 45),
    ]
    blocks = 64
    free = list(range(blocks))
    rng.shuffle(free)
    tables, positions, slots, starts = [], [], [], [0]
    for _, cached, count in sequences:
        table = [free.pop() for _ in range(-(-(cached + count) // block_size))]
        tables.append(table)
        for p in range(cached, cached + count):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + count)
    widest = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn(2, kv_heads, blocks, block_size, dim, generator=generator).to(dtype)
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    starts_tensor = torch.tensor(starts)
    return qkv, torch.tensor(positions), torch.tensor(slots), cache, starts_tensor, table_tensor, heads


@pytest.mark.parametrize("capability", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("dim", "group", "block_size"), [(64, 3, 16), (16, 2, 4), (128, 1, 5), (32, 7, 16)])
def test_a_step_attends_as_float64_attention_over_each_sequences_own_blocks(
    capability, dtype, dim, group, block_size
):
    kernel = kernels.load(capability).paged_attention
    inputs = step(dim, group, block_size, dtype, seed=dim + group)
    qkv, positions, slots, cache, starts, tables, heads = inputs
    for cos, sin in (rope_tables(128, dim), (torch.empty(0), torch.empty(0))):
        expected_cache, expected = reference(qkv, cos, sin, *inputs[1:], 0.3)
        written = cache.clone()
        out = kernel(qkv, cos, sin, positions, slots, written, starts, tables, heads, 0.3)
        assert out.dtype == dtype and out.shape == (len(positions), heads * dim)
        close = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(written.double(), expected_cache.double(), **close)
        torch.testing.assert_close(out.double(), expected, **close)


@pytest.mark.parametrize("capability", BUILDS)
def test_keys_past_a_tokens_position_and_other_sequences_blocks_change_nothing(capability):
    kernel = kernels.load(capability).paged_attention
    qkv, positions, slots, cache, starts, tables, heads = step(64, 3, 16, torch.float32, seed=5)
    cos, sin = rope_tables(128, 64)
    first = kernel(qkv, cos, sin, positions, slots, cache.clone(), starts, tables, heads, 0.125)
    ends = [int(positions[starts[row + 1] - 1]) + 1 for row in range(len(tables))]
    used = {int(b) for table, end in zip(tables, ends, strict=True) for b in table[: -(-end // 16)]}
    poisoned = cache.clone()
    for block in set(range(cache.shape[2])) - used:
        poisoned[:, :, block] = 1e4  # blocks no sequence owns
    poisoned.view(2, 2, -1, 64)[:, :, slots] = -1e4  # slots this step writes before it reads them
    assert torch.equal(kernel(qkv, cos, sin, positions, slots, poisoned, starts, tables, heads, 0.125), first)


@pytest.mark.parametrize("capability", BUILDS)
def test_what_the_kernel_refuses_it_refuses_by_name(capability):
    kernel = kernels.load(capability).paged_attention
    qkv, positions, slots, cache, starts, tables, heads = step(64, 3, 16, torch.float32, seed=1)
    cos, sin = rope_tables(128, 64)

    def call(**change):
        args = {"qkv": qkv, "cos": cos, "sin": sin, "positions": positions, "slots": slots}
        args |= {"cache": cache.clone(), "starts": starts, "tables": tables, "heads": heads, "scale": 1.0}
        args |= change
        return kernel(*args.values())

    with pytest.raises(RuntimeError, match="qkv and cache must both be bfloat16 or both float32"):
        call(qkv=qkv.bfloat16())
    with pytest.raises(RuntimeError, match="slot 9999 outside the cache"):
        call(slots=torch.where(slots == slots[0], 9999, slots))
    with pytest.raises(RuntimeError, match="sequence 0 names block 64 of 64"):
        call(tables=torch.where(tables == tables[0, 0], 64, tables))
    with pytest.raises(RuntimeError, match=r"sequence 4 has a position outside 0 \.\. 127"):
        call(positions=positions.clone().index_fill_(0, torch.tensor([len(positions) - 1]), 128))
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        call(heads=5)
    with pytest.raises(RuntimeError, match="starts must run from 0 to"):
        call(starts=torch.cat((starts[:-1], starts[-1:] - 1)))
