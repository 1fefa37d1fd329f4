"""Runs of decode steps: the scheduler's own against its general rules, and the jumping replay,
which waits them out at once, against the step-by-step one.

An engine whose pure-decode steps go through the scheduler's DecodeRun makes the same tokens,
ends, prices and block state as one that schedules every step by the general rules. The replays:
small cases with preemptions (a cache too small for the load), prefix hits (shared system
prompts, conversations), conversations over several replicas, and long answers on three
replicas, where arrivals land inside runs: every request's token ids and outcome are the same,
its sent, first token and end times equal to float tolerance, the router saw the same loads at
every decision and chose the same replica, every engine took the same steps and ends with the
same block manager (ref counts, free list order, cached hashes), and the jumping one advanced a
fifth of its steps or more inside runs. Two-tier load queued past the age limit is left out:
there the aged-work credit may differ (``docs/simulation-continuous.md``).
"""

from __future__ import annotations

import numpy as np
import pytest

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.router import Router
from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous import replay
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from batcher.sim.continuous.workload import Lengths, Workload
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS
from workers.engine.engine import Engine
from workers.engine.scheduler import Scheduler
from workers.engine.simulated import SimulatedRunner
from workers.sampling import Sampling

ANSWERED, CHOOSE = replay.Prompts.answered, Router.choose


def _model(workers: int, blocks: int) -> ContinuousModelConfig:
    return ContinuousModelConfig(
        name="sim@1",
        simulated="llama-70b",
        workers=workers,
        num_blocks=blocks,
        max_batch_tokens=256,
        max_seqs=32,
    )


def _workload(rate: float, seconds: float, seed: int, turns: int, answer: int, paid: float) -> Workload:
    return Workload.synthetic(
        poisson(rate, seconds, seed),
        {"paid": paid, "free": 1.0 - paid},
        Lengths("uniform", 20, 200),
        Lengths("uniform", 20, answer),
        turns=turns,
        prefixes=2,
        prefix_tokens=48,
        seed=seed,
    )


def _run(monkeypatch, workload: Workload, model: ContinuousModelConfig, jump: bool, eos: float):
    answers: dict[int, list[int]] = {}
    spawns: list[SimulatedEngines] = []
    routes: list[tuple[list[float | None], int]] = []
    answered, choose = ANSWERED, CHOOSE  # the originals, not a previous run's patches

    def record(self, index, ids):
        answers[index] = list(ids)
        answered(self, index, ids)

    def route(self, loads, hashes):
        chosen = choose(self, loads, hashes)
        routes.append((list(loads), chosen.replica))
        return chosen

    class Kept(SimulatedEngines):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spawns.append(self)

    monkeypatch.setattr(replay.Prompts, "answered", record)
    monkeypatch.setattr(Router, "choose", route)
    monkeypatch.setattr(replay, "SimulatedEngines", Kept)
    spec = EngineSpec.of(model, PRESETS["llama-70b"], eos_prob=eos)
    run = replay.replay(workload, model, QueueConfig(wait_budgets=(30.0, 30.0)), spec, seed=3, jump=jump)
    return run, answers, spawns[0], routes


def _blocks(spawn: SimulatedEngines, slot: int):
    blocks = spawn.current(slot).engine.scheduler.blocks
    return blocks.ref, list(blocks.free), blocks.block_hash, blocks.num_evictable, blocks.prefix_hits


CASES = [  # workers, KV blocks, Poisson rate, seconds, workload seed, turns, longest answer, paid share, eos
    (1, 160, 6.0, 6.0, 1, 3, 120, 0.5, 0.0),  # one replica, conversations, preemptions, two tiers
    (1, 400, 8.0, 5.0, 2, 2, 120, 0.5, 0.02),  # ends by end-of-sequence too
    (2, 120, 12.0, 5.0, 3, 1, 600, 1.0, 0.0),  # two replicas behind the router, preemptions
    (2, 120, 14.0, 5.0, 6, 1, 600, 1.0, 0.0),  # another seed
    (2, 1000, 10.0, 5.0, 4, 1, 120, 0.5, 0.01),  # roomy cache: long jumps, prefix hits, two tiers
    (2, 400, 8.0, 6.0, 5, 3, 300, 1.0, 0.0),  # conversations over two replicas: next turns routed
    (3, 2000, 15.0, 5.0, 7, 1, 600, 1.0, 0.0),  # long answers on three replicas: arrivals inside runs
    (3, 300, 15.0, 5.0, 8, 2, 400, 1.0, 0.01),  # three replicas, conversations, preemptions, ends by eos
]


PARAMETERS = ("workers", "blocks", "rate", "seconds", "seed", "turns", "answer", "paid", "eos")


@pytest.mark.parametrize(PARAMETERS, CASES)
def test_the_jumping_replay_equals_the_step_by_step_one(
    monkeypatch, workers, blocks, rate, seconds, seed, turns, answer, paid, eos
):
    workload, model = _workload(rate, seconds, seed, turns, answer, paid), _model(workers, blocks)
    step, step_ids, step_spawn, step_routes = _run(monkeypatch, workload, model, False, eos)
    jump, jump_ids, jump_spawn, jump_routes = _run(monkeypatch, workload, model, True, eos)
    assert jump_routes == step_routes and len(step_routes) >= len(workload)
    assert step_ids == jump_ids and len(step_ids) == (step.outcomes.outcome == 1).sum() > 0
    assert (step.outcomes.outcome == jump.outcomes.outcome).all()
    assert (step.outcomes.tokens == jump.outcomes.tokens).all()
    for times in ("sent", "first", "end"):
        np.testing.assert_allclose(getattr(jump.outcomes, times), getattr(step.outcomes, times), rtol=1e-9)
    assert step.replicas == jump.replicas
    for slot in range(workers):
        assert _blocks(step_spawn, slot) == _blocks(jump_spawn, slot)
    assert sum(r["prefix_hits"] for r in step.replicas) > 0
    if blocks <= 200:
        assert sum(r["preemptions"] for r in step.replicas) > 0
    engines = [engine for starts in jump_spawn.spawned.values() for engine in starts]
    leapt = sum(engine.leapt for engine in engines)
    assert leapt > sum(r["steps"] for r in jump.replicas) / 5  # a fifth of the steps or more, jumped
    assert sum(engine.cut for engine in engines) > 0  # runs that work reached before their end


def test_a_decode_steps_price_from_its_context_sum_is_the_cost_models_own():
    for cost in PRESETS.values():
        contexts = [2000, 17, 4096, 1]
        assert cost.decode_seconds(4, sum(contexts)) == cost.step([1] * 4, contexts).seconds


class GeneralRules(Scheduler):
    """A scheduler that takes every step by its general rules, pure decodes too."""

    def decode_run(self):
        return None


def _engine(general: bool, blocks: int, eos: float) -> Engine:
    runner = SimulatedRunner(PRESETS["smollm2-135m"], num_blocks=blocks, eos_prob=eos, max_model_len=300)
    engine = Engine(runner, EngineConfig(num_blocks=blocks, max_batch_tokens=64, max_seqs=12, watermark=0.0))
    if general:
        engine.scheduler = GeneralRules(engine.config, runner.eos_token_ids, runner.max_model_len)
    return engine


@pytest.mark.parametrize(("blocks", "eos", "rate"), [(40, 0.0, 0.03), (40, 0.03, 0.1), (400, 0.0, 0.1)])
def test_the_schedulers_decode_runs_take_the_steps_its_general_rules_take(blocks, eos, rate):
    """Preemptions (40 blocks), ends by end-of-sequence, stop ids, the model's context and
    aborts land inside runs; the two engines agree step for step."""
    engines = [_engine(general, blocks, eos) for general in (False, True)]
    rng = np.random.default_rng(blocks + int(eos * 100))
    runs = 0
    for step in range(1500):
        arrivals = rng.poisson(rate)
        prompts = [rng.integers(3, 400, rng.integers(5, 120)).tolist() for _ in range(arrivals)]
        lengths = rng.integers(1, 250, arrivals).tolist()
        samplings = [Sampling(n, seed=i, stop_token_ids=(7,) * (i % 3 == 0)) for i, n in enumerate(lengths)]
        aborts = rng.integers(0, 200, 1).tolist() if step % 97 == 0 else []
        outputs = []
        for engine in engines:
            for prompt, sampling in zip(prompts, samplings, strict=True):
                engine.add(prompt, sampling, tier=len(prompt) % 2)
            for rid in aborts:
                engine.abort(rid)
            runs += engine.scheduler.decode_run() is not None
            outputs.append(engine.step())
        assert outputs[0] == outputs[1]
    fast, general = engines
    assert fast.stats() == general.stats() and fast.runner.total_seconds == general.runner.total_seconds
    blocks_of = [(e.scheduler.blocks.ref, list(e.scheduler.blocks.free), e.scheduler.blocks.block_hash)
                 for e in engines]
    assert blocks_of[0] == blocks_of[1]
    assert runs > 100 and fast.stats().generated_tokens > 1000
    if blocks == 40:
        assert fast.stats().preemptions > 0
