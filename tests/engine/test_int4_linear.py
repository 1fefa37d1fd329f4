"""Weight-only int4 (workers/engine/cpu/int4_linear.py): a step of few rows multiplies with the
4-bit copy, as the dequantized matrix would, within bfloat16's rounding; a larger step with the
bfloat16 copy, bit for bit the prepacked matmul's answer; a matrix whose input size is no
multiple of a group, and a model in float32, are refused by name."""

from __future__ import annotations

import pytest
import torch

from workers.engine.cpu.int4_linear import GROUP, Int4Linear, quantize4
from workers.engine.cpu.int8_linear import CROSSOVER
from workers.engine.cpu.packed_linear import PackedLinear, can_pack
from workers.engine.model import load_llama

ONEDNN_BF16 = can_pack(torch.bfloat16, torch.device("cpu"))
pytestmark = pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 here")


def test_few_rows_multiply_with_int4_and_many_with_bfloat16():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 2 * GROUP, generator=generator).bfloat16()
    weight[5, :GROUP] = 0.25  # a group of equal values: no division by zero
    linear = Int4Linear(weight)
    levels, scales_zeros = quantize4(weight)
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)  # [out, groups] each
    grouped = (levels.float().view(96, 2, GROUP) - 8) * scale[..., None] + zero[..., None]
    dequantized = grouped.view(96, 2 * GROUP)
    few = torch.randn(CROSSOVER, 2 * GROUP, generator=generator).bfloat16()
    torch.testing.assert_close(linear(few).float(), few.float() @ dequantized.T, rtol=3e-2, atol=3e-2)
    exact = few.float() @ weight.float().T
    assert 0.01 < float((linear(few).float() - exact).norm() / exact.norm()) < 0.15  # 4 bits' rounding
    many = torch.randn(CROSSOVER + 1, 2 * GROUP, generator=generator).bfloat16()
    assert torch.equal(linear(many), PackedLinear(weight)(many))


def test_int4_refuses_what_it_cannot_group(smollm2):
    with pytest.raises(ValueError, match=f"multiples of {GROUP}, got 40"):
        Int4Linear(torch.zeros(8, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weights: 'int4' needs dtype bfloat16"):
        load_llama(smollm2, torch.float32, torch.device("cpu"), weights="int4")
