"""``ferry simulate`` runs the production scaler in virtual time: a burst on one worker grows the
fleet while starts take ``start_s``, a warm pool answers the same burst sooner, and the GPU time
held is counted each second; the flags reach the scenario. The continuous replay runs the same
scaler over engines that take ``start_s`` to start."""

from __future__ import annotations

import argparse

import numpy as np

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig, ScalerConfig
from batcher.sim.arrivals import Trace, piecewise
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import replay
from batcher.sim.continuous.workload import Lengths, Workload
from batcher.sim.fixed.simulate import Scenario, add_arguments, scenario_from_args, simulate

QUEUE = QueueConfig(wait_budgets=(2.0, 0.5))
BURST = Trace.of(piecewise([(20, 30.0), (60, 120.0), (60, 30.0)], seed=3), {"paid": 0.6, "free": 0.4}, seed=3)
"""30 req/s, then 120 for a minute, then 30: one worker of 50 req/s (10 a 200 ms call) is enough
before and after, three are needed during."""


def run(scaling: ScalerConfig | None, workers: int = 1):
    scenario = Scenario(BURST, params={"max_batch": 10}, workers=workers, queue=QUEUE, scaling=scaling,
                        start_s=10.0, seed=3)
    return simulate(scenario)


def shed(run, tier: str) -> int:
    return run.report.dropped_by_tier[tier]


def test_the_scaler_grows_the_fleet_for_a_burst_and_gives_the_gpus_back():
    fixed, scaled = run(None), run(ScalerConfig(1, 4, scale_down_after=10.0))
    warm = run(ScalerConfig(1, 4, warm_workers=1, scale_down_after=10.0))
    assert max(fixed.held) == 1 and max(scaled.held) == 4 and scaled.held[-1] == 1
    assert shed(scaled, "paid") < shed(fixed, "paid") and shed(warm, "paid") <= shed(scaled, "paid")
    assert shed(warm, "free") < shed(scaled, "free")  # the warm worker serves at once, not 10 s later
    assert fixed.gpu_seconds == len(fixed.held) < scaled.gpu_seconds < 4 * len(scaled.held)


def test_the_scaler_flags_make_the_scenario():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", "2", "--max-workers", "6", "--warm-workers", "1",
                              "--start-s", "480", "--scale-down-after-s", "30"])
    scenario = scenario_from_args(args)
    assert scenario.scaling == ScalerConfig(2, 6, 1, 30.0, 300.0) and scenario.start_s == 480.0


def test_the_continuous_replay_runs_the_scaler_from_zero_with_a_start_time():
    times = piecewise([(30, 1.0), (120, 0.0), (10, 1.0)], seed=5)  # a quiet spell past idle_after_s
    workload = Workload.synthetic(times, {"paid": 1.0}, Lengths("fixed", 50, 50), Lengths("fixed", 20, 20))
    model = ContinuousModelConfig(name="sim@1", simulated="llama-70b", num_blocks=512, max_batch_tokens=256,
                                  min_workers=0, max_workers=1, idle_after_s=30.0)
    run = replay(workload, model, QueueConfig(tiers=("paid",), wait_budgets=(60.0,)),
                 EngineSpec.of(model), start_s=20.0)
    waits = run.outcomes.first - run.outcomes.sent
    assert run.outcomes.counts()["finished"] == len(workload)
    assert waits[0] >= 20.0 and np.median(waits) < 20.0  # the first waited out a start; most did not
    held = "".join(map(str, run.held))
    assert held.startswith("0") and "1" * 25 in held[:40] and "0" * 30 in held[60:150]  # on, off in the lull
    assert held.endswith("1")  # and started again for the last requests
