"""Attention over the paged KV cache: write each token's K and V to its slot, then let every
query read its own sequence's blocks, many sequences per call.

The cache of one layer is ``[kv_heads, num_blocks * block_size, head_dim]`` for K and the same
for V, so gathering a sequence's blocks (``index_select`` along the slot axis) yields, per KV
head, the sequence's context as one contiguous run of positions::

    block table [7, 2, 9]  ->  cache[:, blocks 7, 2, 9]  ->  [kv_heads, 3 * block_size, head_dim]
                                                             positions 0 ... 47, padded past the context

Sequences are attended in groups, each one ``scaled_dot_product_attention`` call over padded
tensors: all decodes of a step together (one query each), all prefill chunks together. Grouped
queries need no copy of K and V: the ``group = heads / kv_heads`` query heads that share a KV
head become rows of that head's query matrix, so a decode is ``group`` rows against its
context and a chunk of ``q`` tokens is ``q * group`` rows::

    q of one sequence   [tokens, kv_heads, group, head_dim]  ->  [kv_heads, tokens * group, head_dim]

The mask comes from positions alone: the row of a token at position ``p`` sees key positions
``0..p``. That is the cached context plus the chunk's own tokens up to itself, never a stale
slot of a reused block past the context, and never another sequence (each has its own rows).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workers.engine.batch import ForwardBatch


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended in one padded call: ``num_seqs`` rows of ``max_query`` query slots."""

    tokens: torch.Tensor  # [n] index in the flat batch of each query token of the group
    rows: torch.Tensor  # [n] where those tokens sit in the padded [num_seqs * max_query] layout
    blocks: torch.Tensor  # [num_seqs * max_blocks] block ids, padded with block 0
    mask: torch.Tensor  # [num_seqs, 1, max_query * group, max_blocks * block_size] bool
    num_seqs: int
    max_query: int
    max_blocks: int
    whole: bool  # the group is the whole batch, in order, unpadded: no index copies needed


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one step's attention runs, built once per step and shared by every layer."""

    slots: torch.Tensor  # [tokens] where each token's K and V are written
    groups: tuple[AttentionGroup, ...]
    block_size: int


def plan_attention(batch: ForwardBatch, block_size: int, group: int, device: torch.device) -> AttentionPlan:
    """Split the batch into a decode group and a prefill group and lay out their indices."""
    starts = [0]
    for length in batch.query_lens:
        starts.append(starts[-1] + length)
    decodes = [i for i, length in enumerate(batch.query_lens) if length == 1]
    prefills = [i for i, length in enumerate(batch.query_lens) if length > 1]
    groups = tuple(
        _group(batch, members, starts, block_size, group, device) for members in (decodes, prefills) if members
    )
    slots = torch.tensor(batch.slot_mapping, dtype=torch.long, device=device)
    return AttentionPlan(slots=slots, groups=groups, block_size=block_size)


def _group(
    batch: ForwardBatch, members: list[int], starts: list[int], block_size: int, group: int, device: torch.device
) -> AttentionGroup:
    max_query = max(batch.query_lens[i] for i in members)
    max_blocks = max(-(-batch.context_lens[i] // block_size) for i in members)
    tokens: list[int] = []
    rows: list[int] = []
    blocks: list[int] = []
    positions = torch.zeros(len(members), max_query, dtype=torch.long)  # padded rows see key 0 only
    for b, i in enumerate(members):
        length = batch.query_lens[i]
        tokens.extend(range(starts[i], starts[i] + length))
        rows.extend(range(b * max_query, b * max_query + length))
        table = batch.block_tables[i][:max_blocks]
        blocks.extend(table)
        blocks.extend([0] * (max_blocks - len(table)))
        positions[b, :length] = torch.tensor(batch.positions[starts[i] : starts[i] + length])
    keys = torch.arange(max_blocks * block_size)
    mask = keys <= positions.repeat_interleave(group, dim=1)[:, :, None]
    whole = len(members) * max_query == batch.num_tokens and tokens == list(range(batch.num_tokens))
    return AttentionGroup(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        mask=mask.unsqueeze(1).to(device),
        num_seqs=len(members),
        max_query=max_query,
        max_blocks=max_blocks,
        whole=whole,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write ``k``, ``v`` ([tokens, kv_heads, head_dim]) to their slots of one layer's cache
    ([kv_heads, slots, head_dim]), then attend ``q`` ([tokens, heads, head_dim]) to each
    sequence's context; returns [tokens, heads * head_dim]."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    k_cache.index_copy_(1, plan.slots, k.transpose(0, 1))
    v_cache.index_copy_(1, plan.slots, v.transpose(0, 1))
    block_size = plan.block_size
    out = None if len(plan.groups) == 1 and plan.groups[0].whole else q.new_empty(tokens, heads * head_dim)
    for g in plan.groups:
        rows = g.num_seqs * g.max_query
        if g.whole:
            padded = q
        else:
            padded = q.new_zeros(rows, heads, head_dim).index_copy_(0, g.rows, q.index_select(0, g.tokens))
        query = (
            padded.view(g.num_seqs, g.max_query, kv_heads, group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(g.num_seqs, kv_heads, g.max_query * group, head_dim)
        )
        context = g.max_blocks * block_size
        key = _gather(k_cache, g, block_size, context)
        value = _gather(v_cache, g, block_size, context)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=g.mask, scale=scale)
        flat = (
            attended.view(g.num_seqs, kv_heads, g.max_query, group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(rows, heads * head_dim)
        )
        if out is None:
            return flat
        out.index_copy_(0, g.tokens, flat if g.whole else flat.index_select(0, g.rows))
    return out


def _gather(cache: torch.Tensor, g: AttentionGroup, block_size: int, context: int) -> torch.Tensor:
    """[num_seqs, kv_heads, context, head_dim]: each sequence's blocks, in table order."""
    kv_heads, _, head_dim = cache.shape
    blocks = cache.view(kv_heads, -1, block_size, head_dim).index_select(1, g.blocks)
    return blocks.view(kv_heads, g.num_seqs, context, head_dim).transpose(0, 1)
