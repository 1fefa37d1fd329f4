"""LLM workloads replayed through the production continuous mode in virtual time: conservation
of requests and KV blocks, conversations that grow turn by turn, and the trace file's form."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import Prompts, replay
from batcher.sim.continuous.workload import Lengths, Workload

MODEL = ContinuousModelConfig(
    name="sim@1", simulated="llama-70b", workers=2, num_blocks=256, max_batch_tokens=256, max_seqs=32
)


def chat(rate: float, seconds: float, seed: int = 1) -> Workload:
    return Workload.synthetic(
        poisson(rate, seconds, seed),
        {"paid": 0.5, "free": 0.5},
        Lengths("uniform", 50, 300),
        Lengths("uniform", 20, 200),
        turns=3,
        prefixes=2,
        prefix_tokens=64,
        seed=seed,
    )


def test_an_overloaded_chat_replay_ends_every_request_exactly_once_and_frees_every_block():
    workload = chat(rate=60, seconds=5)
    run = replay(workload, MODEL, QueueConfig(wait_budgets=(5.0, 0.3)), EngineSpec.of(MODEL))
    counts = run.outcomes.counts()
    assert counts["pending"] == 0 and run.outcomes.duplicates == 0
    assert sum(counts.values()) == len(workload) == run.outcomes.ended
    assert (
        counts["finished"] > 0 and counts["shed"] + counts["expired"] > 0
    )  # overloaded: free work was refused
    assert counts["shed"] == run.shed_by_pool
    refused = (run.outcomes.outcome == 2) | (run.outcomes.outcome == 3)
    assert (run.outcomes.retry_after[refused] > 0).all()  # each refusal told when to come back
    assert np.isnan(run.outcomes.retry_after[~refused]).all()
    assert run.used_at_end == [0, 0]  # every block free (cached prefixes are free blocks)
    finished = run.outcomes.outcome == 1
    assert (run.outcomes.tokens[finished] == workload.answer[finished]).all()  # no token lost or doubled
    assert (run.outcomes.first[finished] <= run.outcomes.end[finished]).all()
    assert sum(r["prefix_hits"] for r in run.replicas) > 0


def test_a_replay_is_a_function_of_its_seed_whatever_order_trio_was_left_in(monkeypatch):
    """trio orders the tasks woken at one virtual instant (a replica's read, the next turn it lets
    in) by a generator each process seeds afresh: left in two states, two replays still agree."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)  # as outside pytest
    workload, queue = chat(rate=60, seconds=3), QueueConfig(wait_budgets=(5.0, 0.5))
    runs = []
    for state in (1, 2):
        trio._core._run._r.seed(state)  # as two processes would leave it
        runs.append(replay(workload, MODEL, queue, EngineSpec.of(MODEL)).outcomes)
    first, second = runs
    assert (first.outcome == second.outcome).all() and (first.tokens == second.tokens).all()
    np.testing.assert_array_equal(first.first, second.first)
    np.testing.assert_array_equal(first.end, second.end)


def test_a_conversations_next_prompt_is_its_history_then_its_new_tokens():
    workload = Workload(
        np.array([0.0, 1.0, 2.0]),
        np.zeros(3, dtype=np.int8),
        np.array([5, 3, 4]),
        np.array([2, 2, 2]),
        np.array([7, 7, -1]),
        np.array([0, 0, 0]),
        ("paid",),
        prefix_tokens=16,
    )
    prompts = Prompts(workload, vocab=1000, seed=0)
    first = prompts.prompt(0)
    assert len(first) == 16 + 5
    prompts.answered(0, [11, 12])
    second = prompts.prompt(1)
    assert second[:23] == (*first, 11, 12) and len(second) == 23 + 3
    alone = prompts.prompt(2)
    assert alone[:16] == first[:16] and len(alone) == 16 + 4  # the shared prefix only


def test_a_trace_round_trips_and_a_bad_row_names_its_line(tmp_path):
    workload = chat(rate=10, seconds=2)
    path = tmp_path / "trace.csv"
    workload.write(str(path))
    read = Workload.read(str(path), ("paid", "free"), prefix_tokens=64)
    assert np.allclose(read.times, workload.times - workload.times[0], atol=1e-6)
    assert (read.prompt == workload.prompt).all() and (read.answer == workload.answer).all()
    assert ((read.conversation >= 0) == (workload.conversation >= 0)).all()
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,tier,prompt_tokens,answer_tokens\n0.0,paid,10,5\n0.5,paid,0,5\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: expected a finite timestamp and token counts"):
        Workload.read(str(bad), ("paid", "free"))


def test_length_distributions_parse_and_draw_within_their_bounds():
    rng = np.random.default_rng(0)
    assert (Lengths.parse("300").draw(5, rng) == 300).all()
    uniform = Lengths.parse("uniform:100:500").draw(1000, rng)
    assert uniform.min() >= 100 and uniform.max() <= 500
    tail = Lengths.parse("lognormal:300:1500").draw(20_000, rng)
    assert np.median(tail) == pytest.approx(300, rel=0.05) and np.percentile(tail, 95) == pytest.approx(
        1500, rel=0.1
    )
    with pytest.raises(ValueError, match="lengths: expected N"):
        Lengths.parse("lognormal:x")


def test_ferry_simulate_continuous_replays_a_chat_trace_and_writes_json(tmp_path, capsys):
    from gateway.cli import main

    trace = tmp_path / "chat.csv"
    chat(rate=5, seconds=4).write(str(trace))
    out = tmp_path / "run.json"
    argv = [
        "simulate",
        "--mode",
        "continuous",
        "--model",
        "llama-8b",
        "--trace",
        str(trace),
        "--prefix-tokens",
        "64",
        "--workers",
        "2",
        "--quiet",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 replicas of llama-8b on 1 x H100 SXM" in printed and "TTFT p50/p95/p99 ms" in printed
    report = json.loads(out.read_text())
    assert sum(report["by_tier"][t]["requests"] for t in ("paid", "free")) == len(chat(rate=5, seconds=4))
    assert len(report["replicas"]) == 2 and report["steps"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shape", "1,2,3"], "--shape: expected 7 positive integers"),
        (["--prompt", "gaussian:1:2"], "lengths: expected fixed, uniform or lognormal"),
        (["--gpus", "0"], "--gpus: expected 1..64"),
        (["--wait-budget-ms", "1000"], "wait_budgets"),
    ],
)
def test_ferry_simulate_continuous_refuses_bad_flags_by_name(flags, message, capsys):
    from gateway.cli import main

    assert main(["simulate", "--mode", "continuous", "--duration", "1", "--quiet", *flags]) == 2
    assert message in capsys.readouterr().err
