"""Weight-only int4 for steps of few rows (model option ``weights = "int4"``; docs/engine.md).

Like :mod:`workers.engine.cpu.int8_linear`, a quarter of bfloat16's bytes: each matrix is kept
in bfloat16 prepacked for oneDNN and in 4 bits, 16 levels from the minimum to the maximum of
each group of :data:`GROUP` input columns of an output row (a scale and a zero each, bfloat16),
and a step of at most ``crossover`` rows multiplies with the 4-bit copy (torch's
``_weight_int4pack_mm_for_cpu``). Groups of 32 are what llama.cpp's Q4 formats use; measured
against bfloat16 and int8 in experiments/docs/engine-int8.md.
"""

from __future__ import annotations

import torch

from workers.engine.cpu.int8_linear import CROSSOVER, FewRowsLinear

GROUP = 32
"""Input columns that share a scale and a zero."""


def quantize4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as levels 0..15 (int32, unpacked) and [in / group, out, 2] bfloat16
    scales and zeros, as torch's CPU kernel reads them: ``weight ~ (level - 8) * scale + zero``.
    A group of equal values gets a tiny scale, not a division by zero."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    levels = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    scales_zeros = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1).contiguous()
    return levels.view(rows, cols), scales_zeros.to(torch.bfloat16)


class Int4Linear(FewRowsLinear):
    """Int4 weights (a scale and a zero per :data:`GROUP` columns) up to ``crossover`` rows, else
    bfloat16. ``weight``'s input columns must be a multiple of :data:`GROUP` (a ValueError says so)."""

    bits = 4

    def __init__(self, weight: torch.Tensor, crossover: int = CROSSOVER) -> None:
        if weight.shape[1] % GROUP:
            columns = weight.shape[1]
            raise ValueError(f"weights: 'int4' needs input sizes in multiples of {GROUP}, got {columns}")
        super().__init__(weight, crossover)
        levels, self.scales_zeros = quantize4(weight.detach())
        self.packed = torch._convert_weight_to_int4pack_for_cpu(levels, 1)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
