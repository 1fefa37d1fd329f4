"""Prepacked oneDNN weights (workers/engine/cpu/packed_linear.py): the same numbers as the plain
layers, bit for bit, at every row count a step makes, and used exactly where they apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.cpu.packed_linear import PackedLinear, can_pack, pack_linears
from workers.engine.model import LAYER_LINEARS, load_llama

CPU = torch.device("cpu")
needs_onednn_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="no oneDNN bfloat16 here")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 32, 300, 2048])
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])  # SmolLM2's qkv, gate-up, down
def test_a_packed_weight_multiplies_exactly_as_f_linear(rows, shape):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16)
    assert torch.equal(PackedLinear(weight)(x), F.linear(x, weight))


@needs_onednn_bf16
def test_a_packed_layer_refuses_an_input_of_the_wrong_shape():
    layer = PackedLinear(torch.zeros(8, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"expected \[rows, 4\], got \[2, 5\]"):
        layer(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="without bias"):
        pack_linears(nn.Sequential(nn.Linear(4, 4)), ("0",))


def test_only_a_bfloat16_model_on_the_cpu_is_packed(tiny_checkpoint):
    f32 = load_llama(tiny_checkpoint, torch.float32, CPU)
    assert all(isinstance(getattr(layer, name), nn.Linear) for layer in f32.layers for name in LAYER_LINEARS)
    bf16 = load_llama(tiny_checkpoint, torch.bfloat16, CPU)
    kinds = {type(getattr(layer, name)) for layer in bf16.layers for name in LAYER_LINEARS}
    assert kinds | {type(bf16.lm_head)} == ({PackedLinear} if can_pack(torch.bfloat16, CPU) else {nn.Linear})
    assert isinstance(f32.lm_head, nn.Linear) and f32.lm_head.weight is f32.embed_tokens.weight  # tied
    assert not can_pack(torch.bfloat16, torch.device("cuda")) and not can_pack(torch.float32, CPU)
