"""Contiguous copies of the decode groups' contexts, kept between steps and appended to.

Gathering a decode group's contexts out of the paged cache copies every context's K and V,
every layer, every step; between two pure-decode steps they only grow by a token each, so the
runner keeps each group's gathered K and V in a tensor with room to grow::

    step n      gather blocks -> copy [layers, 2, seqs, kv_heads, capacity, head_dim]
    step n + 1  write each new token's K and V to its slot (as ever) and to the copy
    ...         until the group changes or outgrows the copy's capacity: gather again

The paged cache stays the truth; the copy mirrors it, within ``budget_bytes``. When a step goes
on with the copies, and why a copy never misses a write: docs/engine.md, "On a CPU"."""

from __future__ import annotations

import dataclasses

import torch

from workers.engine.attention import AttentionGroup, AttentionPlan, CacheShape
from workers.engine.batch import ForwardBatch

HEADROOM_BLOCKS = 8
"""Blocks a copy holds past its longest context when gathered: 8 of 16 tokens is a gather
every 128 decode steps at most for a group that does not change otherwise."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Kept:
    """A copy and what it holds: per sequence (a row), its context and the blocks it came from."""

    buffer: torch.Tensor  # [layers, 2, seqs, kv_heads, capacity, head_dim]
    context_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ContextCopy:
    """One decode group's kept copy for one step: gathered into this step (``gather``, the
    cache rows of every (K or V, sequence, KV head, block) up to the copy's capacity) or
    appended to (``appends``: where each of the step's new K and V rows goes in a layer of it,
    ``sources``: which rows of the step's new ones are this group's, None for all)."""

    buffer: torch.Tensor
    keys: int  # key slots attended: the group's padded context
    gather: torch.Tensor | None
    appends: torch.Tensor | None
    sources: torch.Tensor | None

    def context(self, layer: int, blocks: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s K and V of the group, [2, seqs, kv_heads, keys, head_dim], after
        this step's tokens were written to ``blocks`` (the layer's cache as block rows) and
        are ``new`` (the step's K and V rows, (K or V, KV head, token) order)."""
        copy = self.buffer[layer]
        if self.gather is not None:
            torch.index_select(blocks, 0, self.gather, out=copy.view(-1, blocks.shape[-1]))
        else:
            assert self.appends is not None, "a group copied, not gathered, appends"
            copy.view(-1, new.shape[-1]).index_copy_(
                0, self.appends, new if self.sources is None else new.index_select(0, self.sources)
            )
        return copy[:, :, :, : self.keys]


class ContextCopies:
    """The runner's kept copies, step by step: :meth:`continued` says which decode groups
    continue, :meth:`plan` pairs each of the step's groups with its copy.

    The copies are views of one flat tensor of ``budget_bytes``, taken once: the pages of the
    part never used are never touched, and a step that gathers afresh writes the memory the
    copies it drops held (a fresh tensor every such step cost a page fault a page: 250 ms
    instead of 170 for the step that gathered 32 contexts)."""

    def __init__(self, shape: CacheShape, layers: int, dtype: torch.dtype, budget_bytes: int) -> None:
        self.shape, self.layers, self.dtype = shape, layers, dtype
        self.budget = budget_bytes // dtype.itemsize  # in elements
        self.memory: torch.Tensor | None = None
        self.kept: list[_Kept] = []
        self.continuing: dict[tuple[int, ...], _Kept] = {}
        self.seen: set[tuple[int, tuple[int, ...]]] = set()  # the last step's decodes, as it left them
        self.stable = False  # this step's decodes are the last step's

    def clear(self) -> None:
        """Drop every copy (a step that failed part-way may have appended to some layers only)."""
        self.kept, self.continuing, self.seen = [], {}, set()

    def continued(self, batch: ForwardBatch) -> list[tuple[int, ...]]:
        """The decode groups (sequences by index in ``batch``) whose copies this step continues:
        all of the kept ones, or none (then every decode is grouped afresh, and gathered into
        new copies only if the step's decodes are the last step's, one token on: while the
        batch changes every step, a copy would be gathered and dropped at once, and gathering
        into it, room included, costs more than the plain gather)."""
        self.continuing = {}
        held = {}  # a decode's context before this step, and its blocks: which sequence it is
        for i, (query, context) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            if query == 1:
                held[i] = (context - 1, tuple(batch.block_tables[i][: self._blocks(context - 1)]))
        seen = self.seen
        self.seen = {
            (batch.context_lens[i], tuple(batch.block_tables[i][: self._blocks(batch.context_lens[i])]))
            for i in held
        }
        self.stable = len(held) == len(seen) and all(key in seen for key in held.values())
        rows: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for k, kept in enumerate(self.kept):
            for row, key in enumerate(zip(kept.context_lens, kept.tables, strict=True)):
                rows[key] = (k, row)
        members = [[-1] * len(kept.tables) for kept in self.kept]
        for i, key in held.items():
            place = rows.pop(key, None)
            if place is None or batch.context_lens[i] > self.kept[place[0]].buffer.shape[-2]:
                return []  # a decode no copy holds, or one that outgrew its copy
            members[place[0]][place[1]] = i
        if rows or not self.kept:
            return []  # a kept sequence that does not decode this step, or no copy
        self.continuing = {tuple(m): kept for m, kept in zip(members, self.kept, strict=True)}
        return list(self.continuing)

    def plan(self, batch: ForwardBatch, plan: AttentionPlan) -> tuple[ContextCopy | None, ...]:
        """Per group of ``plan``: the copy its decodes attend over (continued, or gathered now
        with room to grow), or None (a prefill group, decodes that changed since the last step,
        or past the memory bound) to gather from the blocks as before."""
        continuing, self.continuing, self.kept, used = self.continuing, {}, [], 0
        copies: list[ContextCopy | None] = []
        for group in plan.groups:
            copy = None
            if group.max_query == 1 and continuing:
                copy = self._append(batch, group, continuing[group.members].buffer)
            elif group.max_query == 1 and self.stable:
                copy = self._gather(batch, group, used)
            if copy is not None:
                used += copy.buffer.numel()
                self.kept.append(self._kept(batch, group.members, copy.buffer))
            copies.append(copy)
        return tuple(copies)

    def _blocks(self, context: int) -> int:
        return -(-context // self.shape.block_size)

    def _kept(self, batch: ForwardBatch, members: tuple[int, ...], buffer: torch.Tensor) -> _Kept:
        """What ``buffer`` holds once this step ran: the members' contexts and their blocks."""
        lens = tuple(batch.context_lens[i] for i in members)
        tables = tuple(
            tuple(batch.block_tables[i][: self._blocks(n)]) for i, n in zip(members, lens, strict=True)
        )
        return _Kept(buffer, lens, tables)

    def _gather(self, batch: ForwardBatch, group: AttentionGroup, used: int) -> ContextCopy | None:
        """A copy for ``group`` at element ``used`` of the memory, or None past its end."""
        s = self.shape
        capacity = group.max_blocks + HEADROOM_BLOCKS
        size = torch.Size((self.layers, 2, group.num_seqs, s.kv_heads, capacity * s.block_size, s.head_dim))
        if used + size.numel() > self.budget:
            return None
        if self.memory is None:
            self.memory = torch.empty(self.budget, dtype=self.dtype, device=group.tokens.device)
        buffer = self.memory[used : used + size.numel()].view(size)
        blocks = []
        for i in group.members:
            table = batch.block_tables[i][:capacity]
            blocks.append(table + [0] * (capacity - len(table)))
        # Rows in (K or V, sequence, head, block) order, as the copy lays them out.
        kv = torch.arange(2)[:, None, None, None] * (s.kv_heads * s.num_blocks)
        heads = torch.arange(s.kv_heads)[None, None, :, None] * s.num_blocks
        tables = torch.tensor(blocks, dtype=torch.long).view(1, group.num_seqs, 1, capacity)
        gather = (kv + heads + tables).reshape(-1).to(group.tokens.device)
        return ContextCopy(buffer, group.max_blocks * s.block_size, gather, None, None)

    def _append(self, batch: ForwardBatch, group: AttentionGroup, buffer: torch.Tensor) -> ContextCopy:
        s = self.shape
        capacity = buffer.shape[-2]
        # The step's new rows are (K or V, head, token); the copy's, (K or V, sequence, head, key).
        kv = torch.arange(2)[:, None, None]
        heads = torch.arange(s.kv_heads)[None, :, None]
        seqs = torch.arange(group.num_seqs)[None, None, :]
        keys = torch.tensor([batch.context_lens[i] - 1 for i in group.members])[None, None, :]
        appends = ((kv * group.num_seqs + seqs) * s.kv_heads + heads) * capacity + keys
        device, sources = group.tokens.device, None
        if not group.whole:
            tokens = group.tokens.cpu()[None, None, :]
            sources = ((kv * s.kv_heads + heads) * batch.num_tokens + tokens).reshape(-1).to(device)
        keys_attended = group.max_blocks * s.block_size
        return ContextCopy(buffer, keys_attended, None, appends.reshape(-1).to(device), sources)
