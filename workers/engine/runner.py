"""The torch :class:`~workers.engine.batch.Runner`: a Llama checkpoint, its paged KV cache and
a sampler, one :meth:`ModelRunner.execute` per engine step.

The runner owns the cache, ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]`` (K and
V per layer; see :mod:`workers.engine.attention` for why the blocks come after the heads);
the engine's block manager owns which blocks belong to whom and says so through the batch's
block tables and slot mapping. The cache starts zeroed: a slot never written holds finite
numbers, and the attention mask keeps any slot outside a sequence's context out of its sums.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine.attention import CacheShape, PagedAttention, plan_attention
from workers.engine.batch import BatchRunner, ForwardBatch
from workers.engine.checkpoint import read_eos_token_ids
from workers.engine.config import WEIGHTS
from workers.engine.cpu.paged import KernelAttention
from workers.engine.model import Attention, load_llama, placement
from workers.engine.sampler import Sampler

DEFAULT_KV_MEMORY_GB = 1.0


class ModelRunner(BatchRunner):
    """Loads ``model_dir`` (a Hugging Face directory) and runs forward batches over its cache.

    The cache has ``num_blocks`` blocks of ``block_size`` tokens; without ``num_blocks`` it
    takes ``kv_memory_gb`` (10^9 bytes; default 1) divided by the bytes a block holds.
    ``device`` defaults to CUDA where present, else the CPU. ``kernels``: ferry's CPU kernels
    where they run (False: torch's operators everywhere). ``weights``: ``"bf16"``, ``"int8"`` or ``"int4"``
    (:func:`~workers.engine.model.load_llama`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_gb: float | None = None,
        dtype: str = "float32",
        device: str | torch.device | None = None,
        kernels: bool = True,
        weights: str = WEIGHTS[0],
    ) -> None:
        self.dtype, self.device = placement(dtype, device)
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        if num_blocks is not None and kv_memory_gb is not None:
            raise ValueError("num_blocks and kv_memory_gb: give one or the other, not both")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        if kv_memory_gb is not None and not kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb: expected > 0, got {kv_memory_gb}")
        model_dir = Path(model_dir)
        self.model = load_llama(model_dir, self.dtype, self.device, kernels, weights)
        self.config = self.model.config
        self.eos_token_ids = read_eos_token_ids(model_dir)
        self.max_model_len = self.config.max_position_embeddings
        self.kv_bytes_per_token = self.config.kv_bytes_per_token(self.dtype.itemsize)
        self.block_size = block_size
        if num_blocks is None:
            budget = (kv_memory_gb or DEFAULT_KV_MEMORY_GB) * 1e9
            num_blocks = int(budget // (self.kv_bytes_per_token * block_size))
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb: {kv_memory_gb} holds no block of {block_size} tokens")
        self.num_blocks = num_blocks
        config = self.config
        self.kv_cache = torch.zeros(
            (config.num_layers, 2, config.num_kv_heads, num_blocks, block_size, config.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.cache_shape = CacheShape(
            config.num_kv_heads,
            num_blocks,
            block_size,
            config.head_dim,
            config.num_heads // config.num_kv_heads,
        )
        self.sampler = Sampler(self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds across all layers: what a hand-off moves per block."""
        return self.kv_bytes_per_token * self.block_size

    def read_blocks(self, blocks: list[int]) -> bytes:
        """The KV of ``blocks``, block after block (each its layers' K and V), as bytes."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        picked = self.kv_cache.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous()
        return picked.view(-1).view(torch.uint8).cpu().numpy().tobytes()

    def write_blocks(self, blocks: list[int], data: bytearray) -> None:
        """Write ``data`` (:meth:`read_blocks`' layout, of the same model) into ``blocks``."""
        layers, pair, heads, _, size, dim = self.kv_cache.shape
        values = torch.frombuffer(data, dtype=torch.uint8).view(self.dtype)
        values = values.view(len(blocks), layers, pair, heads, size, dim).to(self.device)
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(3, index, values.permute(1, 2, 3, 0, 4, 5))

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> list[int | None]:
        """The next token of each sequence whose ``samples[i]`` is set, None for the others."""
        logits = self.logits(batch)  # runs even when nothing is sampled: the chunk's K and V
        samples = [sample for sample in batch.samples if sample is not None]
        tokens = iter(self.sampler(logits, samples) if samples else [])
        return [None if sample is None else next(tokens) for sample in batch.samples]

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch (writing its K and V to the cache) and return float32 logits
        [sampled sequences, vocab] of the last token of each sequence with a sample."""
        self._check(batch)
        self.model.rotary.ensure(max(batch.positions) + 1)
        kernels = self.model.kernels
        attention: Attention
        if kernels is not None:
            attention = KernelAttention.of(batch, self.kv_cache, kernels.paged_attention)
        else:
            plan = plan_attention(batch, self.cache_shape, self.dtype, self.device)
            attention = PagedAttention(self.kv_cache, plan)
        hidden = self.model(
            torch.tensor(batch.input_ids, device=self.device),
            torch.tensor(batch.positions, device=self.device),
            attention,
        )
        ends, last = [], -1
        for length, sample in zip(batch.query_lens, batch.samples, strict=False):
            last += length
            if sample is not None:
                ends.append(last)
        return self.model.logits(
            hidden.index_select(0, torch.tensor(ends, dtype=torch.long, device=self.device))
        )

    def _check(self, batch: ForwardBatch) -> None:
        """Reject a batch whose lists disagree or that points outside the cache: an index past
        the cache would fault a CUDA kernel instead of raising."""
        tokens, seqs = batch.num_tokens, batch.num_seqs
        if not (len(batch.positions) == len(batch.slot_mapping) == tokens == sum(batch.query_lens) > 0):
            raise ValueError(f"batch: {tokens} input ids, positions, slots and query_lens disagree")
        if not (len(batch.context_lens) == len(batch.block_tables) == len(batch.samples) == seqs):
            raise ValueError(f"batch: {seqs} sequences, context_lens, block_tables and samples disagree")
        if not 0 <= min(batch.slot_mapping) <= max(batch.slot_mapping) < self.num_blocks * self.block_size:
            raise ValueError(
                f"batch.slot_mapping: expected slots in [0, {self.num_blocks * self.block_size})"
            )
        last = -1
        for i, (table, context) in enumerate(zip(batch.block_tables, batch.context_lens, strict=False)):
            last += batch.query_lens[i]
            if not batch.query_lens[i] >= 1 or batch.positions[last] != context - 1:
                # The mask lets a token see positions up to its own: past the context, stale slots.
                raise ValueError(
                    f"batch sequence {i}: expected its last token at position context_lens[{i}] - 1 = "
                    f"{context - 1}, got {batch.positions[last]}"
                )
            if len(table) * self.block_size < context:
                raise ValueError(f"batch.block_tables[{i}]: {len(table)} blocks cannot hold {context} tokens")
            if table and not (min(table) >= 0 and max(table) < self.num_blocks):
                raise ValueError(f"batch.block_tables[{i}]: expected block ids in [0, {self.num_blocks})")
