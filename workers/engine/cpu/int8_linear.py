"""Weight-only int8 for steps of few rows (model option ``weights = "int8"``; docs/engine.md).

A step of a few rows (a lone decode, a handful of decodes) is bound by reading each layer's
weights, not by the arithmetic: int8 halves the bytes read. :class:`Int8Linear` keeps each
matrix twice, rounded to int8 per output row (a symmetric scale, the row's largest magnitude
over 127) and in bfloat16 prepacked for oneDNN (:mod:`workers.engine.cpu.packed_linear`), and
multiplies a step of at most ``crossover`` rows with the int8 copy (torch's
``_weight_int8pack_mm``), a larger one with the bfloat16 copy, where the arithmetic binds and
int8's dequantization would cost. The crossover and the quality against bfloat16 are measured
in experiments/docs/engine-int8.md. The lm_head stays bfloat16: the logits sampling reads.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.cpu.packed_linear import PackedLinear

CROSSOVER = 4
"""Rows of a step at or below which the int8 copy multiplies (experiments/docs/engine-int8.md)."""


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 and a scale per output row (``weight ~ int8 * scale``);
    the scales in ``weight``'s dtype. A row of zeros gets scale 1, not a division by zero."""
    magnitude = weight.float().abs().amax(dim=1).clamp_min(1e-30) / 127.0
    rounded = torch.round(weight.float() / magnitude[:, None]).clamp(-127, 127).to(torch.int8)
    return rounded.contiguous(), magnitude.to(weight.dtype)


class FewRowsLinear(nn.Module):
    """``x @ weight.T`` for 2-D bfloat16 ``x``: a low-bit copy of ``weight`` up to ``crossover``
    rows (:meth:`few_rows`, a subclass's), else the bfloat16 copy prepacked for oneDNN."""

    bits = 16

    def __init__(self, weight: torch.Tensor, crossover: int = CROSSOVER) -> None:
        super().__init__()
        self.dense = PackedLinear(weight)
        self.in_features, self.out_features, self.crossover = weight.shape[1], weight.shape[0], crossover

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [rows, {self.in_features}], got {list(x.shape)}")
        if x.shape[0] > self.crossover:
            return self.dense(x)
        return self.few_rows(x.contiguous())

    def extra_repr(self) -> str:
        rows = f"int{self.bits} up to {self.crossover} rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, {rows}"


class Int8Linear(FewRowsLinear):
    """Int8 weights (a scale per output row) up to ``crossover`` rows, else bfloat16."""

    bits = 8

    def __init__(self, weight: torch.Tensor, crossover: int = CROSSOVER) -> None:
        super().__init__(weight, crossover)
        self.qweight, self.scales = quantize(weight.detach())

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)
