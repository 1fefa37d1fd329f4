"""The KV cache's bookkeeping: blocks, block tables, ref counts, an LRU free list, a prefix cache.

A block is *referenced* while a running sequence has it in its block table, *free* otherwise;
every free block sits on one queue in eviction order::

    head -> [ 4 ] [ 9 ] [ 2 ] [ 7 ] ... [ 5 ] <- tail
            next allocation            freed last

A full block's key is ``hash(parent's hash, its token ids)`` from a root salted by model version
and tenant (:mod:`workers.prefix_hash`, the router's hash too); a new sequence takes every
leading block of its prompt found, never the one holding its last token. Allocation is all or
nothing and leaves ``watermark`` blocks free. Why each rule: docs/engine.md, "The paged KV cache"."""

from __future__ import annotations

from collections.abc import Iterator

from workers.engine.sequence import Sequence
from workers.prefix_hash import chain_hash, prefix_root


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FreeBlockQueue:
    """Free block ids in eviction order: a doubly linked list over ids (O(1) at both ends and in
    the middle, which taking a cached block back for a prefix hit needs), with two sentinels."""

    def __init__(self, num_blocks: int) -> None:
        n = num_blocks
        self._head, self._tail = n, n + 1
        # head -> 0 -> 1 -> ... -> n - 1 -> tail, laid out as whole lists (a cache has ~10^5 blocks)
        self._next: list[int]
        self._prev: list[int]
        if n:
            self._next = [*range(1, n), self._tail, 0, -1]
            self._prev = [self._head, *range(n - 1), -1, n - 1]
        else:
            self._next, self._prev = [self._tail, -1], [-1, self._head]
        self._size = n

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: int) -> bool:
        return self._prev[block] >= 0

    def __iter__(self) -> Iterator[int]:
        block = self._next[self._head]
        while block != self._tail:
            yield block
            block = self._next[block]

    def popleft(self) -> int:
        block = self._next[self._head]
        assert block != self._tail, "pop from an empty free list"
        self.remove(block)
        return block

    def remove(self, block: int) -> None:
        before, after = self._prev[block], self._next[block]
        assert before >= 0, f"block {block} is not free"
        self._next[before], self._prev[after] = after, before
        self._prev[block] = self._next[block] = -1
        self._size -= 1

    def append(self, block: int) -> None:
        self._insert(block, self._prev[self._tail], self._tail)

    def appendleft(self, block: int) -> None:
        self._insert(block, self._head, self._next[self._head])

    def _insert(self, block: int, before: int, after: int) -> None:
        assert self._prev[block] < 0, f"block {block} is already free"
        self._next[before] = self._prev[after] = block
        self._prev[block], self._next[block] = before, after
        self._size += 1


class BlockManager:
    """Which blocks each sequence holds, which are free, and which free ones hold a prefix."""

    def __init__(self, num_blocks: int, block_size: int = 16, watermark: int = 0, salt: str = "") -> None:
        self.num_blocks, self.block_size, self.watermark = num_blocks, block_size, watermark
        self._salt = salt
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks  # what a cached block holds
        self.cached: dict[bytes, int] = {}  # hash -> the block holding those tokens
        self.free = FreeBlockQueue(num_blocks)
        self.num_evictable = 0  # free blocks that still hold a prefix: evictable
        self.prefix_queries = 0  # tokens looked up at first admissions
        self.prefix_hits = 0  # of those, tokens found in the cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, never its last token's block."""
        bs, limit = self.block_size, (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, limit)
        hits: list[int] = []
        for i in range(limit):
            block = self.cached.get(seq.block_hashes[i])
            if block is None or self.block_tokens[block] != tuple(seq.tokens(i * bs, (i + 1) * bs)):
                break
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Give a waiting ``seq`` the blocks ``hits`` (from :meth:`lookup`) and new ones for its
        next ``num_tokens`` tokens, leaving the watermark free; False (and nothing changed) if
        they do not fit."""
        assert not seq.block_table, f"sequence {seq.rid} already holds blocks"
        computed = len(hits) * self.block_size
        new = cdiv(computed + num_tokens, self.block_size) - len(hits)
        revived = sum(1 for block in hits if self.ref[block] == 0)
        keep = self.watermark if self.num_used else 0
        if new + revived > len(self.free) - keep:
            return False
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)
                self.num_evictable -= 1
            self.ref[block] += 1
        seq.block_table = hits + [self._allocate() for _ in range(new)]
        seq.num_computed = computed
        if not seq.preemptions:
            seq.num_cached = computed
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += computed
        return True

    def room(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could compute with its blocks and every free one."""
        return (len(seq.block_table) + len(self.free)) * self.block_size - seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for a running ``seq``'s next ``num_tokens`` tokens (the watermark may go);
        False (and nothing changed) if they do not fit."""
        new = cdiv(seq.num_computed + num_tokens, self.block_size) - len(seq.block_table)
        if new <= 0:
            return True
        if new > len(self.free):
            return False
        seq.block_table.extend(self._allocate() for _ in range(new))
        return True

    def computed(self, seq: Sequence, num_tokens: int) -> None:
        """``seq``'s next ``num_tokens`` slots now hold KV: the blocks that filled become cached."""
        first = seq.num_computed // self.block_size
        seq.num_computed += num_tokens
        self._cache(seq, first)

    def filled(self, seq: Sequence) -> None:
        """The decode ``seq``'s ``num_computed`` already counts filled its last block: it becomes
        cached (a run of decodes moves ``num_computed`` itself)."""
        self._cache(seq, seq.num_computed // self.block_size - 1)

    def _cache(self, seq: Sequence, first: int) -> None:
        """Cache ``seq``'s full blocks from block ``first`` on."""
        bs = self.block_size
        full = seq.num_computed // bs
        if full == first:
            return  # no block filled (the hashes already cover every full block)
        self._extend_hashes(seq, full)
        for i in range(first, full):
            key, block = seq.block_hashes[i], seq.block_table[i]
            if key not in self.cached:  # else another sequence cached the same tokens first
                self.cached[key] = block
                self.block_hash[block] = key
                self.block_tokens[block] = tuple(seq.tokens(i * bs, (i + 1) * bs))

    def free_blocks(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first; those holding a prefix stay cached until evicted."""
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            assert self.ref[block] >= 0, f"block {block} freed twice"
            if self.ref[block] == 0:
                if self.block_hash[block] is None:
                    self.free.appendleft(block)
                else:
                    self.free.append(block)
                    self.num_evictable += 1
        seq.block_table = []

    def _allocate(self) -> int:
        block = self.free.popleft()
        key = self.block_hash[block]
        if key is not None:  # evict the prefix it held
            del self.cached[key]
            self.block_hash[block], self.block_tokens[block] = None, ()
            self.num_evictable -= 1
        self.ref[block] = 1
        return block

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        hashes, bs = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else prefix_root(self._salt, seq.tenant)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, seq.tokens(i * bs, (i + 1) * bs))
            hashes.append(parent)
