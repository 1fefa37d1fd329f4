"""The engine's forecast of its next step, announced before a long one runs: the real engine over
a runner whose steps take their price on a clock of the test's (so what the forecast measures is
exactly what the step took), and the forecast's rule on its own."""

from __future__ import annotations

import math

import pytest

from batcher.continuous.silence import STEP_SLACK
from workers.engine.config import EngineConfig
from workers.engine.cost_model import SMOLLM2_135M, UNBOUNDED, CostModel, Overhead
from workers.engine.engine import Engine
from workers.engine.loop import EngineLoop
from workers.engine.simulated import SimulatedRunner
from workers.engine.step_forecast import ANNOUNCED, StepForecast
from workers.protocol import Add
from workers.sampling import Sampling

# a CPU as `ferry fit` prices one: 20 ms a step, 1 ms a computed token
CPU = CostModel(SMOLLM2_135M, UNBOUNDED, Overhead(step=0.02, token=0.001))
PROMPT = 1000  # tokens: a 1.02 s prefill


class Clock:
    """The engine's wall clock, moved on by each step's price."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def serve(cost: CostModel | None) -> tuple[EngineLoop, Clock, list[float]]:
    """A loop whose engine's steps take their price on its clock, and the announcements it makes."""
    clock, announced = Clock(), []
    runner = SimulatedRunner(CPU, num_blocks=512, wait=clock.advance)
    engine = Engine(runner, EngineConfig(num_blocks=512, max_batch_tokens=2048), clock=clock)
    return EngineLoop(engine, 0.0, watch=StepForecast(announced.append, clock, cost)), clock, announced


def add(rid: int, max_tokens: int) -> Add:
    """A prompt of its own (no prefix another holds)."""
    prompt = [10 + rid + i for i in range(PROMPT)]
    return Add.of(rid, prompt, 0, "acme", Sampling(max_tokens, temperature=0.0))


def run_step(loop: EngineLoop, clock: Clock) -> float:
    """One step; the seconds it took."""
    began = clock.now
    loop.step()
    return clock.now - began


def test_an_engine_announces_its_long_steps_from_what_it_measured_and_its_short_ones_not_at_all():
    loop, clock, announced = serve(cost=None)
    loop.take([add(1, 20)])
    run_step(loop, clock)
    assert announced == [math.inf]  # its first step: nothing measured to tell by
    run_step(loop, clock)
    assert len(announced) == 2  # its first decode: told by the smallest step of the prefill's class
    assert announced[1] == pytest.approx(1.02 / PROMPT * 512)  # at the prefill's rate, long
    for _ in range(5):
        run_step(loop, clock)
    assert len(announced) == 2  # decodes measured: 21 ms, below ANNOUNCED, not announced
    loop.take([add(2, 20)])  # another prompt beside the running decode: a long step
    took = run_step(loop, clock)
    assert len(announced) == 3
    assert took / STEP_SLACK < announced[2] == pytest.approx(took, rel=0.01)


def test_an_engine_with_step_costs_announces_even_its_first_long_step_at_its_price():
    loop, clock, announced = serve(cost=CPU)
    loop.take([add(1, 2)])
    took = run_step(loop, clock)
    assert announced == [pytest.approx(took)] and took == pytest.approx(1.02)
    assert announced[0] >= ANNOUNCED


def test_a_size_classs_rate_rises_at_once_and_falls_halfway_a_step():
    clock, announced = Clock(), []
    forecast = StepForecast(announced.append, clock)

    def step(tokens: int, seconds: float) -> None:
        forecast.begin([tokens], [tokens])
        clock.advance(seconds)
        forecast.end()

    step(100, 1.0)  # 10 ms a token
    assert forecast.measured(100) == pytest.approx(1.0)
    assert forecast.measured(120) == pytest.approx(1.2)  # same class (64..127)
    assert forecast.measured(1000) == pytest.approx(10.0)  # a larger class: scaled up from below
    assert forecast.measured(10) == pytest.approx(0.64)  # smaller than any: the class's smallest step
    step(100, 3.0)  # the CPU got busy: 30 ms a token at once
    assert forecast.measured(100) == pytest.approx(3.0)
    step(100, 1.0)  # and quiet again: halfway down
    assert forecast.measured(100) == pytest.approx(2.0)
    assert announced == [math.inf, pytest.approx(1.0), pytest.approx(3.0)]
