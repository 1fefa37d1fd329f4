"""Weight-only int8 (workers/engine/cpu/int8_linear.py): a step of few rows multiplies with the
int8 copy, as the dequantized matrix would, within bfloat16's rounding of the real one; a larger
step with the bfloat16 copy, bit for bit the prepacked matmul's answer; and a model in float32,
where no int8 path exists, is refused by name."""

from __future__ import annotations

import pytest
import torch

from workers.engine.cpu.int8_linear import CROSSOVER, Int8Linear, quantize
from workers.engine.cpu.packed_linear import PackedLinear, can_pack
from workers.engine.model import load_llama

ONEDNN_BF16 = can_pack(torch.bfloat16, torch.device("cpu"))
pytestmark = pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 here")


def test_few_rows_multiply_with_int8_and_many_with_bfloat16():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    weight[5] = 0  # a row of zeros: scale 1, no division by zero
    linear = Int8Linear(weight)
    qweight, scales = quantize(weight)
    dequantized = qweight.float() * scales.float()[:, None]
    few = torch.randn(CROSSOVER, 64, generator=generator).bfloat16()
    torch.testing.assert_close(linear(few).float(), few.float() @ dequantized.T, rtol=2e-2, atol=2e-2)
    exact = few.float() @ weight.float().T
    error = (linear(few).float() - exact).norm() / exact.norm()
    assert error < 0.02  # int8's rounding: ~1 % of the product
    assert not torch.equal(linear(few), PackedLinear(weight)(few))  # the int8 copy did answer
    many = torch.randn(CROSSOVER + 1, 64, generator=generator).bfloat16()
    assert torch.equal(linear(many), PackedLinear(weight)(many))
    with pytest.raises(ValueError, match=r"expected \[rows, 64\]"):
        linear(torch.zeros(2, 63, dtype=torch.bfloat16))


def test_int8_weights_need_bfloat16(smollm2):
    with pytest.raises(ValueError, match="weights: 'int8' needs dtype bfloat16"):
        load_llama(smollm2, torch.float32, torch.device("cpu"), weights="int8")
