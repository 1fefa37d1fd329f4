"""The block manager: exact block ids for allocation, reuse and eviction; the prefix cache's
rules (per tenant and model version, never the whole prompt, recompute is no hit, collisions);
and its invariants after every step of random workloads through the whole engine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.support.paged_runner import PagedRunner, reference
from workers.engine import block_manager
from workers.engine.block_manager import BlockManager, FreeBlockQueue, cdiv
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.sampling import Sampling


def running(bm: BlockManager, rid: int, tokens: list[int], tenant: str = "") -> Sequence:
    """A sequence admitted with its prefix hits and all its tokens computed."""
    seq = Sequence(rid, tokens, tenant=tenant)
    hits = bm.lookup(seq)
    assert bm.admit(seq, hits, len(tokens) - len(hits) * bm.block_size)
    bm.computed(seq, len(tokens) - seq.num_computed)
    return seq


def test_the_free_queue_removes_from_the_middle_and_keeps_its_order():
    queue = FreeBlockQueue(5)
    assert list(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(2)
    assert list(queue) == [0, 1, 3, 4] and 2 not in queue and 3 in queue
    assert queue.popleft() == 0
    queue.append(2)
    queue.appendleft(0)
    assert list(queue) == [0, 1, 3, 4, 2] and len(queue) == 5
    assert [queue.popleft() for _ in range(5)] == [0, 1, 3, 4, 2] and len(queue) == 0


def test_new_blocks_come_in_id_order_and_a_finished_tail_is_reused_first_its_prefix_last():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = running(bm, 0, list(range(10)))  # blocks 0 and 1 full (cached), block 2 holds 2 tokens
    b = running(bm, 1, list(range(100, 106)))
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    bm.free_blocks(a)
    assert list(bm.free) == [2, 5, 6, 7, 1, 0]  # the partial tail first; the prefix, tail first, last
    assert (bm.num_free, bm.num_used, bm.num_evictable) == (6, 2, 2)
    c = running(bm, 2, list(range(200, 205)))
    assert c.block_table == [2, 5]
    d = running(bm, 3, list(range(300, 313)))  # 4 blocks: the never used ones, then a's, tail first
    assert d.block_table == [6, 7, 1, 0]
    assert bm.num_evictable == 0 and list(bm.cached.values()) == [3, 2, 6, 7, 1]  # b, c and d: full blocks


def test_the_least_recently_freed_prefix_is_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = running(bm, 0, [1, 2, 3, 4])  # blocks 0, 1: both full
    b = running(bm, 1, [5, 6, 7, 8])  # blocks 2, 3
    bm.free_blocks(b)
    bm.free_blocks(a)
    assert list(bm.free) == [3, 2, 1, 0]  # b freed first: its tail, then its head, then a's
    c = running(bm, 2, [9, 9, 9])
    assert c.block_table == [3, 2]
    assert bm.lookup(Sequence(3, [5, 6, 7, 8, 0])) == []  # b's prefix is gone
    assert bm.lookup(Sequence(4, [1, 2, 3, 4, 0])) == [0, 1]  # a's is still there


def test_a_prefix_hit_takes_the_cached_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = list(range(33))
    first = running(bm, 0, prompt)
    assert first.block_table == [0, 1, 2] and first.num_cached == 0
    bm.free_blocks(first)
    second = Sequence(1, prompt)
    assert bm.lookup(second) == [0, 1]
    assert bm.admit(second, [0, 1], 1)
    assert second.block_table == [0, 1, 2] and second.num_computed == 32 and second.num_cached == 32
    assert (bm.prefix_queries, bm.prefix_hits) == (66, 32)
    assert bm.lookup(Sequence(2, prompt[:32])) == [0]  # 32 tokens: the second block holds the last one
    assert bm.lookup(Sequence(3, prompt[:16])) == []


def test_a_shared_block_is_freed_only_by_its_last_holder():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = running(bm, 0, list(range(9)))
    b = running(bm, 1, list(range(9)))
    assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3])
    assert bm.ref[:4] == [2, 2, 1, 1]
    bm.free_blocks(a)
    assert bm.ref[:4] == [1, 1, 0, 1] and list(bm.free) == [2, 4, 5]
    bm.free_blocks(b)
    assert bm.num_free == 6 and list(bm.free) == [3, 2, 4, 5, 1, 0]


def test_two_tenants_and_two_model_versions_never_share_a_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    bm.free_blocks(running(bm, 0, prompt, tenant="acme"))
    assert bm.lookup(Sequence(1, prompt, tenant="globex")) == []
    assert bm.lookup(Sequence(2, prompt, tenant="acme")) == [0, 1]
    other = BlockManager(num_blocks=8, block_size=4, salt="model@2")
    other.free_blocks(running(other, 0, prompt, tenant="acme"))
    assert Sequence(3, prompt, tenant="acme").block_hashes == []
    seq = Sequence(4, prompt, tenant="acme")
    other.lookup(seq)
    assert seq.block_hashes[0] not in bm.cached


def test_recompute_after_a_preemption_reuses_blocks_without_counting_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running(bm, 0, list(range(10)))
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    bm.free_blocks(seq)
    seq.num_computed = 0
    seq.preemptions.append(1.0)
    hits = bm.lookup(seq)
    assert hits == [0, 1] and bm.admit(seq, hits, 2)
    assert seq.num_computed == 8 and seq.num_cached == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = running(bm, 0, list(range(12)))
    b = Sequence(1, list(range(50, 58)))
    assert not bm.admit(b, [], 8)
    assert b.block_table == [] and b.num_computed == 0 and list(bm.free) == [3]
    assert (bm.prefix_queries, bm.prefix_hits) == (12, 0)
    assert not bm.grow(a, 5) and a.block_table == [0, 1, 2]
    assert bm.grow(a, 4) and a.block_table == [0, 1, 2, 3]


def test_admissions_leave_the_watermark_to_the_running_decodes():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=2)
    a = Sequence(0, list(range(40)))
    assert bm.admit(a, [], 20)  # nothing in use: an admission may take the whole cache
    assert len(a.block_table) == 5
    b = Sequence(1, list(range(100, 116)))
    assert not bm.admit(b, [], 16)  # 4 blocks would leave 1 of the 2 kept free
    assert bm.admit(b, [], 12)
    bm.computed(a, 20)
    assert bm.grow(a, 8) and bm.num_free == 0  # a running sequence may use the watermark


def test_a_hash_collision_does_not_hand_out_another_prompts_blocks(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"every block collides")
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.free_blocks(running(bm, 0, [1, 2, 3]))
    assert bm.lookup(Sequence(1, [7, 8, 3])) == []
    assert bm.lookup(Sequence(2, [1, 2, 9])) == [0]


class EngineWorkload(RuleBasedStateMachine):
    """Random requests, aborts and steps through a small, contended cache.

    Prompts share a few prefixes (so prefix hits happen), the cache is small (so preemptions
    happen), the budget is small (so prompts are prefilled in chunks) and some prompts are longer
    than the whole cache. After every rule the block manager's books must balance exactly.
    """

    BLOCK, BLOCKS = 4, 12
    PREFIXES = ([], list(range(1, 9)), list(range(1, 17)), [5] * 12)

    def __init__(self) -> None:
        super().__init__()
        self.runner = PagedRunner(self.BLOCK, self.BLOCKS)
        config = EngineConfig(self.BLOCK, self.BLOCKS, max_batch_tokens=10, max_seqs=4, watermark=0.1)
        self.engine = Engine(self.runner, config, clock=lambda: float(len(self.runner.batches)))
        self.bm = self.engine.scheduler.blocks
        self.requests: dict[int, tuple[list[int], Sampling]] = {}
        self.outputs: dict[int, list[int]] = {}

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.integers(1, 48).flatmap(lambda n: st.lists(st.integers(1, 39), min_size=n, max_size=n)),
        max_tokens=st.integers(1, 12),
        tier=st.integers(0, 1),
        tenant=st.sampled_from(["acme", "globex"]),
        ignore_eos=st.booleans(),
    )
    def add(self, prefix, suffix, max_tokens, tier, tenant, ignore_eos):
        sampling = Sampling(max_tokens=max_tokens, ignore_eos=ignore_eos)
        rid = self.engine.add(prefix + suffix, sampling, tier=tier, tenant=tenant)
        self.requests[rid], self.outputs[rid] = (prefix + suffix, sampling), []

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.engine.scheduler.sequences)
        if live:
            assert self.engine.abort(data.draw(st.sampled_from(live)))
        assert not self.engine.abort(10**9)

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.one_step()

    def one_step(self):
        output = self.engine.step()
        assert output.scheduled_tokens <= 10 and len(output.tokens) <= 4
        for rid, token in output.tokens.items():
            self.outputs[rid].append(token)
        for done in output.finished:
            prompt, sampling = self.requests.pop(done.rid)
            expected, reason = reference(prompt, sampling)
            got = self.outputs.pop(done.rid)
            assert got == expected[: len(got)] and done.usage.output_tokens == len(got)
            if done.reason is FinishReason.TOO_LONG:  # it needed a block for its next token
                assert cdiv(len(prompt) + len(got), self.BLOCK) > self.BLOCKS
            elif done.reason is not FinishReason.ABORTED:
                assert (got, done.reason) == (expected, reason)

    @invariant()
    def books_balance(self):
        bm, scheduler = self.bm, self.engine.scheduler
        free = list(bm.free)
        assert len(free) == len(set(free)) == bm.num_free
        assert bm.num_free + sum(1 for ref in bm.ref if ref > 0) == bm.num_blocks
        holders = [0] * bm.num_blocks
        for seq in scheduler.sequences.values():
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == [] and seq.num_computed == 0
            else:
                assert len(seq.block_table) == cdiv(seq.num_computed, self.BLOCK)
            for block in seq.block_table:
                holders[block] += 1
        assert holders == bm.ref  # every block freed exactly as often as it was taken
        assert all(bm.ref[block] == 0 for block in free)
        assert bm.num_evictable == sum(1 for block in free if bm.block_hash[block] is not None)

    @invariant()
    def every_cached_block_holds_its_tokens(self):
        bm, kv = self.bm, self.runner.kv
        for key, block in bm.cached.items():
            assert bm.block_hash[block] == key and len(bm.block_tokens[block]) == self.BLOCK
            held = [kv[block * self.BLOCK + offset] for offset in range(self.BLOCK)]
            assert [entry[1] for entry in held] == list(bm.block_tokens[block])
        assert sum(key is not None for key in bm.block_hash) == len(bm.cached)

    def teardown(self):
        for _ in range(2000):
            if not self.engine.has_work:
                break
            self.one_step()
        assert not self.engine.has_work and self.requests == {}
        assert self.bm.num_used == 0


TestEngineWorkload = EngineWorkload.TestCase
TestEngineWorkload.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("tokens", [1, 4, 5, 8])
def test_lookup_never_hits_the_block_of_the_last_token(tokens):
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.free_blocks(running(bm, 0, list(range(8))))
    assert len(bm.lookup(Sequence(1, list(range(tokens))))) == (tokens - 1) // 4
