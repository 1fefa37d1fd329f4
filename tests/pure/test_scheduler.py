"""The scheduler, step by step: exactly which sequences each step computes, how many tokens each,
which one is preempted, when nothing is admitted, and how sequences end."""

from __future__ import annotations

import pytest

from workers.engine.config import EngineConfig
from workers.engine.scheduler import Schedule, Scheduler
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.sampling import Sampling

EOS = 2
FOREVER = Sampling(max_tokens=10_000, ignore_eos=True)


def scheduler(**config) -> Scheduler:
    return Scheduler(EngineConfig(**{"watermark": 0.0, **config}), eos_token_ids=frozenset({EOS}))


def add(
    s: Scheduler, rid: int, prompt_len: int, tier: int = 0, sampling: Sampling = FOREVER
) -> Sequence:
    seq = Sequence(rid, [100 + rid] * prompt_len, sampling, tier=tier, arrival=float(rid))
    s.add(seq)
    return seq


def step(s: Scheduler, now: float = 0.0, token: int = 7) -> Schedule:
    """One step in which every sequence that reaches its last token samples ``token``."""
    plan = s.schedule(now)
    sampled = [
        token if seq.num_computed + n == seq.num_tokens else None
        for seq, n in zip(plan.seqs, plan.num_tokens, strict=False)
    ]
    s.postprocess(plan, sampled, now)
    return plan


def planned(plan: Schedule) -> list[tuple[int, int]]:
    return [(seq.rid, n) for seq, n in zip(plan.seqs, plan.num_tokens, strict=False)]


def test_running_sequences_go_first_then_waiting_ones_by_tier_and_arrival():
    s = scheduler(block_size=4, num_blocks=64, max_batch_tokens=32, max_seqs=8)
    for rid, tier in [(0, 1), (1, 0), (2, 1), (3, 0)]:
        add(s, rid, 4, tier)
    assert planned(step(s)) == [(1, 4), (3, 4), (0, 4), (2, 4)]
    add(s, 4, 3, tier=1)
    add(s, 5, 3, tier=0)
    assert planned(step(s)) == [(1, 1), (3, 1), (0, 1), (2, 1), (5, 3), (4, 3)]
    assert [seq.rid for seq in s.running] == [1, 3, 5, 0, 2, 4]


def test_a_prompt_chunk_leaves_a_token_for_every_decode_behind_it_and_admissions_take_the_rest():
    s = scheduler(block_size=16, num_blocks=256, max_batch_tokens=512, max_seqs=8)
    add(s, 0, 16, tier=0)
    add(s, 1, 16, tier=1)
    assert planned(step(s)) == [(0, 16), (1, 16)]
    add(s, 2, 910, tier=0)
    assert planned(step(s)) == [(0, 1), (1, 1), (2, 510)]
    add(s, 3, 200, tier=1)
    assert planned(step(s)) == [(0, 1), (2, 400), (1, 1), (3, 110)]  # the module's picture


def test_a_50000_token_prompt_is_prefilled_in_chunks_beside_every_running_decode():
    s = scheduler(block_size=16, num_blocks=3400, max_batch_tokens=512, max_seqs=16)
    decodes = [add(s, rid, 20, tier=1) for rid in range(10)]
    step(s)
    long = add(s, 10, 50_000, tier=0)  # paid, so first in priority order once running: the stall risk
    chunks = []
    while not long.output_ids:
        plan = dict(planned(step(s)))
        assert sum(plan.values()) <= 512
        assert [plan[rid] for rid in range(10)] == [1] * 10  # no decode skipped, ever
        chunks.append(plan[10])
    assert chunks == [502] * 99 + [50_000 - 99 * 502]
    assert all(len(seq.output_ids) == 101 for seq in decodes)


def test_when_blocks_run_out_the_lowest_tier_newest_sequence_is_preempted():
    s = scheduler(block_size=4, num_blocks=6, max_batch_tokens=64, max_seqs=8)
    paid0, free0, free1, paid1 = add(s, 0, 4, 0), add(s, 1, 4, 1), add(s, 2, 4, 1), add(s, 3, 4, 0)
    step(s, now=1.0)  # each holds one full block and has sampled one token
    late = add(s, 4, 2, tier=1)
    plan = step(s, now=2.0)  # each decode needs a second block; 2 are free
    assert planned(plan) == [(0, 1), (3, 1), (1, 1)]
    assert [seq.rid for seq in plan.preempted] == [2]
    assert free1.status is SequenceStatus.WAITING and free1.num_computed == 0 and free1.block_table == []
    assert free1.output_ids == [7] and free1.preemptions == [2.0]
    assert s.queued(1) == [free1, late]  # back at the head of its tier; nothing admitted
    assert [seq.rid for seq in s.running] == [0, 3, 1] and s.preemptions == 1
    assert (paid0.num_computed, paid1.num_computed, free0.num_computed) == (5, 5, 5)


def test_a_preempted_sequence_resumes_from_its_cached_blocks_without_counting_a_hit():
    s = scheduler(block_size=4, num_blocks=7, max_batch_tokens=64, max_seqs=8)
    for rid, tier in [(0, 0), (1, 1), (2, 1), (3, 0)]:
        add(s, rid, 4, tier)
    step(s)
    assert [seq.rid for seq in step(s).preempted] == [2]  # the last in line: it preempts itself
    assert s.blocks.num_evictable == 1  # its full prompt block stays cached
    queries, hits = s.blocks.prefix_queries, s.blocks.prefix_hits
    s.abort(0, now=3.0)  # frees two blocks: room for 2 again
    plan = step(s)
    assert planned(plan) == [(3, 1), (1, 1), (2, 1)]  # 4 of its 5 tokens came from the cache
    assert (s.blocks.prefix_queries, s.blocks.prefix_hits) == (queries, hits)
    assert s.sequences[2].num_cached == 0 and s.sequences[2].output_ids == [7, 7]


def test_strict_priority_a_paid_prompt_that_does_not_fit_holds_back_smaller_free_ones():
    s = scheduler(block_size=4, num_blocks=4, max_batch_tokens=64, max_seqs=8)
    add(s, 0, 8)
    step(s)  # 0 holds 2 blocks (+1 on its next decode)
    add(s, 1, 8, tier=0)
    add(s, 2, 1, tier=1)
    assert planned(step(s)) == [(0, 1)]
    assert [seq.rid for seq in s.queued(0)] == [1] and [seq.rid for seq in s.queued(1)] == [2]


def test_the_running_cap_limits_admissions():
    s = scheduler(block_size=4, num_blocks=64, max_batch_tokens=64, max_seqs=2)
    for rid in range(3):
        add(s, rid, 4)
    assert planned(step(s)) == [(0, 4), (1, 4)]
    assert planned(step(s)) == [(0, 1), (1, 1)]


def test_a_prompt_larger_than_the_whole_cache_ends_too_long_on_arrival():
    s = scheduler(block_size=4, num_blocks=3)
    seq = add(s, 0, 13)
    assert s.finished == [seq] and seq.finish_reason is FinishReason.TOO_LONG and not s.sequences
    assert s.details[0] == "needs 4 blocks of 4 tokens alone; the KV cache holds 3"
    assert planned(step(s)) == []


def test_a_sequence_that_outgrows_the_cache_alone_ends_too_long_instead_of_looping():
    s = scheduler(block_size=4, num_blocks=2, max_batch_tokens=16, max_seqs=4)
    seq = add(s, 0, 6)
    plans = [planned(step(s, now=float(t))) for t in range(5)]
    assert plans == [[(0, 6)], [(0, 1)], [(0, 1)], [], []]
    assert seq.finish_reason is FinishReason.TOO_LONG and seq.output_ids == [7, 7, 7]
    assert seq.finished_at == 3.0 and s.blocks.num_free == 2 and s.preemptions == 0
    assert s.details[0] == "needs 3 blocks of 4 tokens alone; the KV cache holds 2"


def test_the_model_s_context_refuses_a_prompt_that_fills_it_and_ends_an_answer_that_reaches_it():
    s = Scheduler(EngineConfig(block_size=4, num_blocks=64, watermark=0.0), max_model_len=10)
    full = add(s, 0, 10)
    assert s.finished == [full] and full.finish_reason is FinishReason.TOO_LONG
    assert s.details[0] == "a prompt of 10 tokens leaves no room in the model's context of 10"
    seq = add(s, 1, 7)
    plans = [planned(step(s)) for _ in range(4)]
    assert plans == [[(1, 7)], [(1, 1)], [(1, 1)], []]
    assert seq.finish_reason is FinishReason.MAX_TOKENS and seq.num_tokens == 10  # FOREVER asked 10,000


def test_a_prefill_chunk_shrinks_to_the_room_left_when_there_is_nobody_to_preempt():
    s = scheduler(block_size=4, num_blocks=4, max_batch_tokens=8, max_seqs=4)
    add(s, 0, 4)
    long = add(s, 1, 14, tier=1)
    assert planned(step(s)) == [(0, 4), (1, 4)]
    assert planned(step(s)) == [(0, 1), (1, 4)]  # 7 tokens would need 2 more blocks; 1 is free
    assert planned(step(s)) == [(0, 1)]  # no room at all: it preempts itself
    assert long.status is SequenceStatus.WAITING and long.num_computed == 0 and s.preemptions == 1


def test_abort_frees_a_sequence_s_blocks_at_once_whether_running_or_waiting():
    s = scheduler(block_size=4, num_blocks=8, max_batch_tokens=64, max_seqs=1)
    first, second = add(s, 0, 9), add(s, 1, 4)
    step(s)
    assert s.blocks.num_free == 5
    assert s.abort(0, now=5.0) and s.abort(1, now=5.0) and not s.abort(0, now=6.0)
    assert s.blocks.num_free == 8 and not s.running and not s.num_waiting and not s.sequences
    assert [(seq.rid, seq.finish_reason, seq.finished_at) for seq in s.finished] == [
        (0, FinishReason.ABORTED, 5.0),
        (1, FinishReason.ABORTED, 5.0),
    ]
    assert first.output_ids == [7] and second.output_ids == []


@pytest.mark.parametrize(
    ("sampling", "tokens", "reason", "kept"),
    [
        (Sampling(max_tokens=5), [7, 8, EOS], FinishReason.EOS, 3),
        (
            Sampling(max_tokens=5, ignore_eos=True),
            [EOS, EOS, EOS, EOS, EOS],
            FinishReason.MAX_TOKENS,
            5,
        ),
        (Sampling(max_tokens=5, stop_token_ids=(9,)), [7, 9], FinishReason.STOP_TOKEN, 2),
        (Sampling(max_tokens=2), [7, 7], FinishReason.MAX_TOKENS, 2),
    ],
)
def test_a_sequence_stops_on_eos_a_stop_token_or_max_tokens(sampling, tokens, reason, kept):
    s = scheduler(block_size=4, num_blocks=8, max_batch_tokens=64, max_seqs=4)
    seq = add(s, 0, 3, sampling=sampling)
    for now, token in enumerate(tokens, start=10):
        assert not seq.finished
        step(s, now=float(now), token=token)
    assert (seq.finish_reason, seq.output_ids) == (reason, tokens[:kept])
    assert (seq.first_scheduled, seq.first_token, seq.finished_at) == (10.0, 10.0, 10.0 + len(tokens) - 1)
    assert s.finished == [seq] and not s.running and s.blocks.num_used == 0


def test_a_live_rid_cannot_be_added_twice():
    s = scheduler()
    add(s, 0, 3)
    with pytest.raises(ValueError, match="rid 0: already in the engine"):
        add(s, 0, 3)


def test_a_tier_s_seats_go_to_its_tenants_by_the_tokens_each_was_given_over_its_weight():
    """One seat; heavy queued first, 4 sequences of 8 prompt tokens; light (weight 2) 8 of 4. Each
    answers 1 token: heavy is given 9 tokens a sequence, light 5 over 2, so light's 4 sequences
    go for each of heavy's (one tenant alone is FIFO: every other test)."""
    s = scheduler(block_size=4, num_blocks=256, max_batch_tokens=64, max_seqs=1)
    for rid in range(4):
        s.add(Sequence(rid, [100 + rid] * 8, Sampling(max_tokens=1), tenant="heavy", arrival=float(rid)))
    for rid in range(4, 12):
        s.add(Sequence(rid, [100 + rid] * 4, Sampling(max_tokens=1), tenant="light", arrival=float(rid),
                       weight=2.0))
    order = []
    while s.sequences:
        order += [seq.rid for seq, n in zip(*step(s)[:2], strict=False) if seq.num_computed == n]
    assert order == [0, 4, 5, 6, 7, 1, 8, 9, 10, 11, 2, 3]
