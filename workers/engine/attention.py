"""Attention over the paged KV cache with torch's operators (where ferry's CPU kernel cannot run:
CUDA, a CPU without AVX2, no compiler; :mod:`workers.engine.cpu.paged` elsewhere): write each
token's K and V to its slot, then let every query read its own sequence's blocks.

One layer's cache is ``[2, kv_heads, num_blocks, block_size, head_dim]``: a row per (K or V, KV
head, block) is one contiguous run, so a step gathers every context with one ``index_select`` of
whole rows. Sequences are attended in groups, one ``scaled_dot_product_attention`` call each
(:func:`partition`); a prompt prefilled whole needs no gather. The query heads sharing a KV head
become rows of its query, no K or V copied::

    q of one sequence   [tokens, kv_heads, group, head_dim]  ->  [kv_heads, tokens * group, head_dim]

A token at position ``p`` sees keys ``0..p``, its mask from positions alone (docs/engine.md)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from workers.engine.batch import ForwardBatch
from workers.engine.model import Projection


@dataclasses.dataclass(frozen=True, slots=True)
class CacheShape:
    kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    group: int  # query heads per KV head


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended in one padded call: ``num_seqs`` rows of ``max_query`` query slots."""

    members: tuple[int, ...]  # the group's sequences, by index in the batch, in batch order
    tokens: torch.Tensor  # [n] index in the flat batch of each query token of the group
    rows: torch.Tensor  # [n] where those tokens sit in the padded [num_seqs * max_query] layout
    reads: torch.Tensor  # [2 * num_seqs * kv_heads * max_blocks] cache rows, padded with block 0
    mask: torch.Tensor  # [num_seqs, 1, max_query * group or 1, max_blocks * block_size]: 0 or -inf
    num_seqs: int
    max_query: int
    max_blocks: int
    whole: bool  # the group is the whole batch, in order, unpadded: no index copies needed


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one step's attention runs, built once per step and shared by every layer."""

    writes: torch.Tensor  # [2 * kv_heads * tokens] where each token's K and V rows go
    groups: tuple[AttentionGroup, ...]
    shape: CacheShape
    fresh: tuple[tuple[int, int], ...] = ()  # (first token, tokens) of each prompt attended alone


def plan_attention(
    batch: ForwardBatch,
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionPlan:
    """Lay out the indices of each group :func:`partition` forms, apart from the prompts
    :func:`fresh_prompts` attends alone; the masks are additive, in the model's ``dtype`` (what
    the attention adds to its scores)."""
    starts = [0]
    for length in batch.query_lens:
        starts.append(starts[-1] + length)
    alone = fresh_prompts(batch.query_lens, batch.context_lens)
    groups = tuple(
        _group(batch, list(members), starts, shape, dtype, device)
        for members in partition(batch.query_lens, batch.context_lens, shape.block_size, alone)
    )
    # Token slots as rows of [2 * kv_heads * slots, head_dim]: (K or V, head) major, slot minor.
    slots = torch.tensor(batch.slot_mapping, dtype=torch.long)
    planes = torch.arange(2 * shape.kv_heads)[:, None] * (shape.num_blocks * shape.block_size)
    fresh = tuple((starts[i], batch.query_lens[i]) for i in alone)
    return AttentionPlan((planes + slots).reshape(-1).to(device), groups, shape, fresh)


GROUP_OVERHEAD = 1024
"""What one more padded call costs, in query rows x key slots of attention work: a call's fixed
cost (gather, kernel launch, index copies) over the rate a decode group reads key slots, both
measured (experiments/docs/constants.md)."""


def fresh_prompts(query_lens: list[int], context_lens: list[int]) -> list[int]:
    """The sequences (by index) attended alone: prompts prefilled whole in this step (their
    context is this step's tokens) whose causal triangle saves more than the call costs, that is
    whose skipped upper half (``tokens**2 / 2`` query-key pairs) is more than ``GROUP_OVERHEAD``."""
    return [
        i
        for i, (query, context) in enumerate(zip(query_lens, context_lens, strict=True))
        if query == context and query * query > 2 * GROUP_OVERHEAD
    ]


def partition(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    alone: Sequence[int] = (),
) -> list[list[int]]:
    """Sequences (by index) into attention groups, each padded to its longest query and context;
    the sequences in ``alone`` are in none (they are attended on their own, :func:`fresh_prompts`).

    One group for everything would pad a 20-token context to the step's longest (800), and a
    decode's one query to the longest prefill chunk; one call per sequence would pay a call's
    fixed cost hundreds of times per layer. So decodes and prefill chunks go apart, each into
    buckets of similar size (query length and context blocks by powers of two), and neighbouring
    buckets merge while a merge costs less than the call it saves (``GROUP_OVERHEAD``)::

        decodes' context blocks    1 2 2 7 | 57 63 62          two calls (16-token blocks)
        prefill chunks' tokens     3 | 200                     two more
    """
    buckets: dict[tuple[bool, int, int], list[int]] = {}
    taken = set(alone)
    for i, (query, context) in enumerate(zip(query_lens, context_lens, strict=False)):
        if i in taken:
            continue
        blocks = -(-context // block_size)
        buckets.setdefault((query > 1, (query - 1).bit_length(), (blocks - 1).bit_length()), []).append(i)

    def cost(members: list[int]) -> int:
        widest = max(-(-context_lens[i] // block_size) for i in members) * block_size
        return len(members) * max(query_lens[i] for i in members) * widest

    groups: list[list[int]] = []
    for prefill in (False, True):
        run = [members for key, members in sorted(buckets.items()) if key[0] == prefill]
        while len(run) > 1:
            savings = [cost(a) + cost(b) + GROUP_OVERHEAD - cost(a + b) for a, b in itertools.pairwise(run)]
            best = max(range(len(savings)), key=savings.__getitem__)
            if savings[best] <= 0:
                break
            run[best : best + 2] = [run[best] + run[best + 1]]
        # In batch order within a group: a group that is the whole batch then needs no copies.
        groups.extend(sorted(members) for members in run)
    return groups


def _group(
    batch: ForwardBatch,
    members: list[int],
    starts: list[int],
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionGroup:
    max_query = max(batch.query_lens[i] for i in members)
    max_blocks = max(-(-batch.context_lens[i] // shape.block_size) for i in members)
    tokens: list[int] = []
    rows: list[int] = []
    blocks: list[int] = []
    padded_positions: list[int] = []  # padded query rows take position 0: they see key 0 only
    for b, i in enumerate(members):
        length = batch.query_lens[i]
        tokens.extend(range(starts[i], starts[i] + length))
        rows.extend(range(b * max_query, b * max_query + length))
        table = batch.block_tables[i][:max_blocks]
        blocks.extend(table)
        blocks.extend([0] * (max_blocks - len(table)))
        padded_positions.extend(batch.positions[starts[i] : starts[i] + length])
        padded_positions.extend([0] * (max_query - length))
    positions = torch.tensor(padded_positions, dtype=torch.long).view(len(members), max_query)
    # Rows in (K or V, sequence, head, block) order: the gather lands as [2, seqs, heads, keys, dim].
    kv = torch.arange(2)[:, None, None, None] * (shape.kv_heads * shape.num_blocks)
    heads = torch.arange(shape.kv_heads)[None, None, :, None] * shape.num_blocks
    tables = torch.tensor(blocks, dtype=torch.long).view(1, len(members), 1, max_blocks)
    keys = torch.arange(max_blocks * shape.block_size)
    # A decode's query rows all see the same keys: one mask row, broadcast over them.
    rows_positions = positions if max_query == 1 else positions.repeat_interleave(shape.group, dim=1)
    mask = torch.zeros(rows_positions.shape + keys.shape, dtype=dtype)
    mask.masked_fill_(keys > rows_positions[:, :, None], float("-inf"))
    whole = len(members) * max_query == batch.num_tokens and tokens == list(range(batch.num_tokens))
    return AttentionGroup(
        members=tuple(members),
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        reads=(kv + heads + tables).reshape(-1).to(device),
        mask=mask.unsqueeze(1).to(device),
        num_seqs=len(members),
        max_query=max_query,
        max_blocks=max_blocks,
        whole=whole,
    )


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(query @ keys^T * scale + mask) @ values`` over [seqs, kv_heads, rows, head_dim]:
    ``scaled_dot_product_attention``, for decodes (a KV head's query heads as its rows, one mask
    row broadcast over them) as for prefill chunks: one path, as fast as two plain matmuls on a
    decode group with torch 2.13 (experiments/docs/engine-step.md)."""
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


@dataclasses.dataclass(frozen=True, slots=True)
class PagedAttention:
    """The :class:`~workers.engine.model.Attention` of one engine step: every layer's paged
    cache, ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]``, and the step's plan."""

    kv_cache: torch.Tensor
    plan: AttentionPlan

    def __call__(self, layer: int, projection: Projection, scale: float) -> torch.Tensor:
        q, k, v = projection.rotated()
        return paged_attention(q, k, v, self.kv_cache[layer], self.plan, scale)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Write ``k``, ``v`` ([tokens, kv_heads, head_dim]) to their slots of one layer's cache,
    then attend ``q`` ([tokens, heads, head_dim]) to each sequence's context: a fresh prompt's
    is its own ``k`` and ``v``, a group's is gathered from the blocks. Returns [tokens, heads *
    head_dim]."""
    tokens, heads, head_dim = q.shape
    s = plan.shape
    new = torch.stack((k, v)).transpose(1, 2).reshape(-1, head_dim)  # (K or V, head, token) rows
    cache.view(-1, head_dim).index_copy_(0, plan.writes, new)
    blocks = cache.view(-1, s.block_size * head_dim)
    out = None if len(plan.groups) == 1 and plan.groups[0].whole else q.new_empty(tokens, heads * head_dim)
    for start, length in plan.fresh:
        span = slice(start, start + length)
        query, key, value = (x[span].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, len, dim]
        attended = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=True
        )
        assert out is not None, "a step with fresh prompts is more than one whole group"
        out[span] = attended[0].transpose(0, 1).reshape(length, heads * head_dim)
    for g in plan.groups:
        rows = g.num_seqs * g.max_query
        dense = g.whole or g.max_query == 1  # no padded query slot: rows are the group's tokens
        if g.whole:
            padded = q
        elif g.max_query == 1:
            padded = q.index_select(0, g.tokens)
        else:
            padded = q.new_zeros(rows, heads, head_dim).index_copy_(0, g.rows, q.index_select(0, g.tokens))
        query = (
            padded.view(g.num_seqs, g.max_query, s.kv_heads, s.group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(g.num_seqs, s.kv_heads, g.max_query * s.group, head_dim)
        )
        context = blocks.index_select(0, g.reads).view(2, g.num_seqs, s.kv_heads, -1, head_dim)
        attended = attend(query, context[0], context[1], g.mask, scale)
        flat = (
            attended.view(g.num_seqs, s.kv_heads, g.max_query, s.group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(rows, heads * head_dim)
        )
        if out is None:
            return flat
        out.index_copy_(0, g.tokens, flat if dense else flat.index_select(0, g.rows))
    assert out is not None, "one whole group returned its rows"
    return out
