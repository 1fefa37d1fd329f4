"""The engine: the exact ForwardBatch of small steps, a sequence taking blocks another just left
(and must not inherit its position), and answers equal to full recompute under preemption, prefix hits,
chunked prefill and slot reuse, through a runner that really reads its KV through the pages."""

from __future__ import annotations

import random

import pytest

from tests.support.paged_runner import PagedRunner, next_token, reference
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.interface import SequenceEnd
from workers.engine.sequence import FinishReason
from workers.protocol import EngineStats, Usage
from workers.sampling import Sampling


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(
    block_size: int, num_blocks: int, max_batch_tokens: int, max_seqs: int = 4
) -> tuple[Engine, PagedRunner]:
    runner = PagedRunner(block_size, num_blocks)
    config = EngineConfig(block_size, num_blocks, max_batch_tokens, max_seqs, watermark=0.0)
    return Engine(runner, config, clock=Clock()), runner


def test_the_first_steps_of_a_decode_and_a_chunked_prompt_are_exact():
    eng, runner = engine(block_size=4, num_blocks=16, max_batch_tokens=8)
    short = Sampling(max_tokens=3, ignore_eos=True)
    assert eng.add([1, 2, 3], short) == 0
    assert eng.add([10, 11, 12, 13, 14, 15], short) == 1
    first = eng.step()
    assert runner.batches[0] == ForwardBatch(
        input_ids=[1, 2, 3, 10, 11, 12, 13, 14],
        positions=[0, 1, 2, 0, 1, 2, 3, 4],
        slot_mapping=[0, 1, 2, 4, 5, 6, 7, 8],
        query_lens=[3, 5],
        context_lens=[3, 5],
        block_tables=[[0], [1, 2]],
        samples=[Sample(short, 0), None],
    )
    a0 = next_token([1, 2, 3])
    assert (first.tokens, first.finished, first.preempted, first.scheduled_tokens) == ({0: a0}, [], [], 8)
    assert eng.stats() == EngineStats(
        step=1,
        running=2,
        waiting=0,
        free_blocks=13,
        used_blocks=3,
        total_blocks=16,
        cached_blocks=0,
        preemptions=0,
        prefix_queries=9,
        prefix_hits=0,
        computed_tokens=8,
        generated_tokens=1,
    )
    second = eng.step()
    assert runner.batches[1] == ForwardBatch(
        input_ids=[a0, 15],
        positions=[3, 5],
        slot_mapping=[3, 9],
        query_lens=[1, 1],
        context_lens=[4, 6],
        block_tables=[[0], [1, 2]],
        samples=[Sample(short, 1), Sample(short, 0)],
    )
    assert second.tokens == {0: next_token([1, 2, 3, a0]), 1: next_token([10, 11, 12, 13, 14, 15])}


def test_a_sequence_admitted_into_the_blocks_another_just_left_starts_from_its_own_position_zero():
    eng, runner = engine(block_size=4, num_blocks=3, max_batch_tokens=16)
    two = Sampling(max_tokens=2, ignore_eos=True)
    eng.add([1, 2, 3, 4, 5, 6], two)
    eng.add([20, 21, 22, 23, 24], two)  # needs 2 blocks: waits while the first holds 2 of 3
    assert eng.step().tokens.keys() == {0}
    done = eng.step()
    assert done.finished == [SequenceEnd(0, FinishReason.MAX_TOKENS, Usage(6, 0, 2))]
    assert list(eng.scheduler.blocks.free) == [1, 2, 0]  # its half-used tail first, its full prefix last
    eng.step()
    assert runner.batches[2] == ForwardBatch(
        input_ids=[20, 21, 22, 23, 24],
        positions=[0, 1, 2, 3, 4],  # not 7, where the last sequence in block 1 left off
        slot_mapping=[4, 5, 6, 7, 8],
        query_lens=[5],
        context_lens=[5],  # only its own tokens: block 1's stale KV from the first is overwritten
        block_tables=[[1, 2]],
        samples=[Sample(two, 0)],
    )
    tokens = [eng.step().tokens[1]]
    assert [next_token([20, 21, 22, 23, 24]), *tokens] == reference([20, 21, 22, 23, 24], two)[0]


def test_answers_equal_full_recompute_under_preemption_prefix_hits_chunks_and_slot_reuse():
    rng = random.Random(9)
    eng, runner = engine(block_size=4, num_blocks=24, max_batch_tokens=16, max_seqs=6)
    system = [rng.randrange(1, 40) for _ in range(12)]
    requests: dict[int, tuple[list[int], Sampling]] = {}
    outputs: dict[int, list[int]] = {}
    finished: dict[int, FinishReason] = {}
    holders: list[set[int]] = [set() for _ in range(24)]  # block -> every rid that held it

    def step() -> None:
        output = eng.step()
        for rid, token in output.tokens.items():
            outputs[rid].append(token)
        finished.update((done.rid, done.reason) for done in output.finished)
        for seq in eng.scheduler.running:
            for block in seq.block_table:
                holders[block].add(seq.rid)

    for _ in range(40):
        for _ in range(rng.randrange(0, 3)):
            prompt = (system if rng.random() < 0.5 else []) + [
                rng.randrange(1, 40) for _ in range(rng.randrange(1, 48))
            ]
            sampling = Sampling(max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.5)
            rid = eng.add(prompt, sampling, tier=rng.randrange(2), tenant=rng.choice("ab"))
            requests[rid], outputs[rid] = (prompt, sampling), []
        for _ in range(rng.randrange(1, 4)):
            step()
    while eng.has_work:
        step()
    assert finished.keys() == requests.keys() and len(requests) > 30
    for rid, (prompt, sampling) in requests.items():
        assert (outputs[rid], finished[rid]) == reference(prompt, sampling), rid
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.prefix_hits > 0 and stats.used_blocks == 0
    assert any(None in batch.samples for batch in runner.batches)  # chunked prefill happened
    assert all(len(rids) > 1 for rids in holders)  # every block served several sequences


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size": 0}, "EngineConfig.block_size: expected an integer >= 1, got 0"),
        ({"num_blocks": -3}, "EngineConfig.num_blocks: expected an integer >= 1, got -3"),
        ({"max_batch_tokens": 2.5}, "EngineConfig.max_batch_tokens: expected an integer >= 1, got 2.5"),
        ({"max_seqs": 600}, r"EngineConfig.max_seqs: expected <= max_batch_tokens \(512\) .* got 600"),
        ({"watermark": 1.0}, r"EngineConfig.watermark: expected a fraction in \[0, 1\), got 1.0"),
    ],
)
def test_a_bad_config_names_its_field_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_the_config_must_fit_the_runner_s_cache():
    with pytest.raises(ValueError, match="must fit the runner's cache \\(8 blocks of 4\\)"):
        Engine(PagedRunner(4, 8), EngineConfig(block_size=4, num_blocks=9))
    with pytest.raises(ValueError, match="block_size 16"):
        Engine(PagedRunner(4, 8), EngineConfig(block_size=16, num_blocks=8))


def test_rids_are_the_caller_s_or_the_next_free_number_and_abort_ignores_unknown_ones():
    eng, _ = engine(block_size=4, num_blocks=8, max_batch_tokens=8)
    assert eng.add([1], rid=1) == 1
    assert eng.add([1]) == 0 and eng.add([1]) == 2
    with pytest.raises(ValueError, match="rid 2: already in the engine"):
        eng.add([1], rid=2)
    with pytest.raises(ValueError, match="expected at least one prompt token"):
        eng.add([])
    assert not eng.abort(7) and eng.abort(2)
    assert [done.rid for done in eng.step().finished] == [2]
    assert not eng.abort(2)
