"""TPOT targets in the engine's scheduler: how many sequences run together, and whose sequence
yields its seat to whom (workers/engine/seats.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.config import EngineConfig
from workers.engine.cost_model import SMOLLM2_135M, UNBOUNDED, CostModel, Overhead
from workers.engine.scheduler import Scheduler
from workers.engine.seats import Seats, longest_context, who_yields
from workers.engine.sequence import Sequence, SequenceStatus
from workers.sampling import Sampling

# a decode step: 10 ms, plus 2 ms a sequence, plus 1 us a context token
COST = CostModel(SMOLLM2_135M, UNBOUNDED, Overhead(step=0.010, seq=0.002, context=1e-6))
ANSWER = Sampling(max_tokens=100, ignore_eos=True)


def scheduler(cost: CostModel | None = COST, max_seqs: int = 64) -> Scheduler:
    config = EngineConfig(block_size=4, num_blocks=4096, max_batch_tokens=512, max_seqs=max_seqs,
                          watermark=0.0)
    return Scheduler(config, cost=cost)


def seq(rid: int, tenant: str = "H", tier: int = 0, target: float = 0.030, prompt: int = 20,
        weight: float = 1.0) -> Sequence:
    return Sequence(rid, [100 + rid] * prompt, ANSWER, tier=tier, tenant=tenant, weight=weight,
                    arrival=float(rid), tpot_target=target)


def step(s: Scheduler, now: float = 0.0) -> list[int]:
    """One step, every sequence at its last token sampling 7; the rids the step computed."""
    plan = s.schedule(now)
    sampled = [7 if q.num_computed + n == q.num_tokens else None
               for q, n in zip(plan.seqs, plan.num_tokens, strict=True)]
    s.postprocess(plan, sampled, now)
    return [q.rid for q in plan.seqs]


def running(s: Scheduler, tenant: str) -> int:
    return sum(q.tenant == tenant for q in s.running)


def test_a_target_seats_as_many_sequences_as_its_decode_step_allows():
    # 30 ms: 10 + 2 n + 0.12 n (120 context tokens each, at their longest) <= 30 -> n <= 9
    s = scheduler()
    for rid in range(20):
        s.add(seq(rid))
    step(s)
    assert len(s.running) == 9
    assert COST.decode_seconds(9, 9 * 120) <= 0.030 < COST.decode_seconds(10, 10 * 120)
    assert s.num_waiting == 11


def test_without_a_target_or_a_cost_model_max_seqs_alone_bounds_the_seats():
    for s, target in ((scheduler(), 0.0), (scheduler(cost=None), 0.030)):
        for rid in range(20):
            s.add(seq(rid, target=target))
        step(s)
        assert len(s.running) == 20


def test_the_strictest_target_of_the_running_sequences_binds_every_sequence():
    s = scheduler()
    s.add(seq(0, target=0.016))  # 10 + 2 n + 0.12 n <= 16 -> n <= 2
    for rid in range(1, 10):
        s.add(seq(rid, target=0.0))
    step(s)
    assert len(s.running) == 2


def test_one_sequence_runs_even_when_its_step_alone_breaks_the_target():
    s = scheduler()
    s.add(seq(0, target=0.001))
    s.add(seq(1, target=0.001))
    step(s)
    assert [q.rid for q in s.running] == [0]


def test_a_light_tenant_takes_a_seat_from_the_heavy_one_at_once_and_only_once():
    s = scheduler()
    for rid in range(24):
        s.add(seq(rid, "H"))
    for _ in range(3):
        step(s)
    assert running(s, "H") == 9
    s.add(seq(100, "L"))
    computed = step(s)
    assert 100 in computed and running(s, "L") == 1 and running(s, "H") == 8
    assert s.preemptions == 1
    (yielded,) = [q for q in s.sequences.values() if q.preemptions]
    assert (yielded.tenant, yielded.status, yielded.rid) == ("H", SequenceStatus.WAITING, 8)  # H's newest
    for _ in range(20):  # no seat goes back and forth
        step(s)
    assert s.preemptions == 1 and running(s, "L") == 1


def test_a_tenant_alone_never_preempts_itself_and_a_lower_tier_yields_to_a_higher_one():
    s = scheduler()
    for rid in range(12):
        s.add(seq(rid, "H", tier=1))
    step(s)
    step(s)
    assert s.preemptions == 0 and len(s.running) == 9
    s.add(seq(50, "P", tier=0))
    assert 50 in step(s)
    assert s.preemptions == 1 and running(s, "P") == 1


def test_while_nobody_waiting_can_be_seated_the_running_decodes_run_as_one_run():
    s = scheduler()
    for rid in range(12):
        s.add(seq(rid, "H"))
    for _ in range(8):  # the prompts, then the first tokens
        step(s)
    assert s.num_waiting == 3
    assert s.decode_run() is not None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ABC"), st.sampled_from([0, 1]),
                          st.sampled_from([0.0, 0.020, 0.030, 0.050]), st.integers(1, 300)),
                min_size=1, max_size=40),
       st.lists(st.integers(0, 3), min_size=40, max_size=40))
def test_the_decode_step_of_the_running_sequences_stays_within_the_strictest_target(arrivals, gaps):
    s = scheduler()
    steps = 0
    for rid, (tenant, tier, target, prompt) in enumerate(arrivals):
        s.add(seq(rid, tenant, tier, target, prompt))
        for _ in range(gaps[rid] if rid < len(arrivals) - 1 else 6000):
            if not s.sequences:
                break
            step(s, float(steps))
            steps += 1
            seats = s.seats
            assert seats is not None
            strictest = min((q.tpot_target for q in s.running if q.tpot_target), default=0.0)
            context = sum(longest_context(q, None) for q in s.running)
            assert (seats.seats, seats.context) == (len(s.running), context)
            if len(s.running) > 1 and strictest:
                assert COST.decode_seconds(len(s.running), context) <= strictest
    assert not s.sequences  # every sequence ended: no seat traded back and forth for ever


def test_who_yields_moves_a_seat_only_where_the_shares_grow_more_even():
    h = [seq(rid, "H") for rid in range(4)]
    assert who_yields(h, seq(10, "L")) is h[-1]  # 3 / 1 >= 1 / 1
    assert who_yields(h[:1], seq(10, "L")) is None  # 0 < 1: H would only trade places with L
    assert who_yields(h[:2], seq(10, "L")) is h[1]  # 1 >= 1
    assert who_yields([*h[:2], seq(11, "L")], seq(12, "L")) is None  # 1 < 2
    assert who_yields(h, seq(10, "H")) is None  # its own tenant
    assert who_yields(h, seq(10, "L", weight=0.25)) is None  # (3 / 1) < (1 / 0.25)
    free = seq(20, "F", tier=1)
    assert who_yields([*h, free], seq(10, "H")) is free  # a lower tier yields first


def test_seats_count_what_sits_and_leaves():
    seats = Seats(COST, max_model_len=50)
    a, b = seq(0, prompt=40), seq(1, prompt=10, target=0.0)
    seats.sit(a)
    seats.sit(b)
    assert (seats.seats, seats.context, seats.target()) == (2, 100, 0.030)  # 50 (the model's) + 50
    seats.leave(a)
    assert (seats.seats, seats.context, seats.target()) == (1, 50, 0.0)
    assert seats.step_seconds() == COST.decode_seconds(1, 50)


def test_a_prompt_beside_promised_decodes_advances_in_chunks_that_keep_the_step_within_the_target():
    cost = CostModel(SMOLLM2_135M, UNBOUNDED, Overhead(step=0.010, seq=0.002, token=0.0001))
    config = EngineConfig(block_size=4, num_blocks=4096, max_batch_tokens=512, max_seqs=64, watermark=0.0)
    s = Scheduler(config, cost=cost)
    for rid in range(3):
        s.add(seq(rid, "H"))
    step(s)  # their prompts: each samples its first token
    s.add(seq(9, "L", prompt=2000, target=0.0))
    chunks = []
    while s.sequences[9].remaining > 1:
        plan = s.schedule(0.0)
        queries = list(plan.num_tokens)
        contexts = [q.num_computed + n for q, n in zip(plan.seqs, queries, strict=True)]
        assert cost.step(queries, contexts).seconds <= 0.030 + 1e-9
        chunks.append(queries[plan.seqs.index(s.sequences[9])])
        s.postprocess(plan, [7 if q.num_computed + n == q.num_tokens else None
                             for q, n in zip(plan.seqs, queries, strict=True)], 0.0)
    # 10 + 4 x 2 + 0.1 x tokens <= 30 ms: 120 tokens a step, 3 of them the decodes
    assert chunks[0] == 117 and len(chunks) == 18


def test_ferry_simulate_holds_the_paid_target_with_the_engines_own_rule(tmp_path, capsys):
    from gateway.cli import main

    tpot = {}
    for target in ("0,0", "20,0"):
        out = tmp_path / f"{target}.json"
        argv = ["simulate", "--mode", "continuous", "--model", "llama-8b", "--rate", "40", "--duration", "10",
                "--workers", "1", "--quiet", "--tpot-target-ms", target, "--json", str(out)]
        assert main(argv) == 0
        tpot[target] = json.loads(out.read_text())["by_tier"]["paid"]["tpot"]["p95"]
    assert tpot["0,0"] > 0.025 and tpot["20,0"] <= 0.020
