"""bfloat16 matmuls on the CPU with each weight laid out once, at load, the way oneDNN reads it.

``F.linear`` on a bfloat16 CPU tensor has oneDNN reorder the weight into its blocked layout on
every call, which a decode step pays for every matrix of every layer. :class:`PackedLinear`
keeps the reordered copy (``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with it
(``torch.ops.mkldnn._linear_pointwise``), as torch's inductor does for a frozen model: oneDNN's
arithmetic either way, so the same output bit for bit (docs/engine.md; measured in
experiments/docs/engine-vs-vllm.md). Packing applies only where it can: bfloat16, on the CPU,
with oneDNN able to do bfloat16; anywhere else the model keeps its ``nn.Linear`` layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can take prepacked weights of ``dtype`` on ``device`` here."""
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """``x @ weight.T`` for 2-D ``x`` ([rows, in_features]), with ``weight`` reordered once."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [rows, {self.in_features}], got {list(x.shape)}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(
    module: nn.Module, names: tuple[str, ...], packed: Callable[[torch.Tensor], nn.Module] = PackedLinear
) -> None:
    """Replace ``module``'s ``nn.Linear`` children called ``names`` by ``packed(weight)``, a
    :class:`PackedLinear` unless said otherwise (the plain weight is dropped with the old layer,
    so memory does not double)."""
    for name in names:
        linear = getattr(module, name)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"{name}: expected an nn.Linear without bias, got {linear!r}")
        setattr(module, name, packed(linear.weight))
