"""Attention of one engine step through the paged-attention kernel (``csrc/paged_attention.cpp``):
the step's slots, positions, sequence starts and block tables as tensors, built once and read by
every layer's call, which rotates Q and K as it loads them, writes K and V to their slots and
attends each query to its sequence's blocks where they lie: no gather, no padding, nothing kept
between steps (docs/engine.md, "On a CPU")."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import torch

from workers.engine.batch import ForwardBatch
from workers.engine.model import Projection


@dataclasses.dataclass(frozen=True, slots=True)
class KernelAttention:
    """The :class:`~workers.engine.model.Attention` of one step over ``kv_cache``, ``[layers, 2,
    kv_heads, num_blocks, block_size, head_dim]``, through ``kernel``."""

    kv_cache: torch.Tensor
    kernel: Callable[..., torch.Tensor]
    positions: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [tokens] int64
    starts: torch.Tensor  # [seqs + 1] int64: sequence s owns tokens starts[s] .. starts[s + 1] - 1
    tables: torch.Tensor  # [seqs, max_blocks] int32, each padded with block 0

    @classmethod
    def of(
        cls, batch: ForwardBatch, kv_cache: torch.Tensor, kernel: Callable[..., torch.Tensor]
    ) -> KernelAttention:
        widest = max(len(table) for table in batch.block_tables)
        tables = np.zeros((batch.num_seqs, widest), dtype=np.int32)
        for row, table in enumerate(batch.block_tables):
            tables[row, : len(table)] = table
        starts = [0, *itertools.accumulate(batch.query_lens)]
        return cls(
            kv_cache,
            kernel,
            torch.tensor(batch.positions, dtype=torch.long),
            torch.tensor(batch.slot_mapping, dtype=torch.long),
            torch.tensor(starts, dtype=torch.long),
            torch.from_numpy(tables),
        )

    def __call__(self, layer: int, projection: Projection, scale: float) -> torch.Tensor:
        rope = projection.rope
        cache = self.kv_cache[layer]
        return self.kernel(projection.qkv, rope.cos, rope.sin, self.positions, self.slots, cache, self.starts,
                           self.tables, projection.heads, scale)
