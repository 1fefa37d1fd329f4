"""The step-cost fit: known constants priced into synthetic steps come back out, bad input is a
clear error, the file it writes loads as the same cost model, and an overhead leaves every
GPU preset's arithmetic alone."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from batcher.sim.continuous.simulate import cost_from_args
from workers.engine.cost_model import PRESETS, SMOLLM2_135M, UNBOUNDED, CostModel, Overhead
from workers.engine.fit.cost_fit import Measured, as_dict, fit, from_dict, load, measured, save

CPU = Overhead(step=0.020, seq=0.0008, token=0.0012, context=2.5e-6, pair=4e-9)


def designed_steps(overhead: Overhead, noise: float = 0.0, seed: int = 0) -> list[Measured]:
    """Decodes at several batch sizes and contexts, prefill chunks alone, and mixed steps,
    each priced by ``overhead`` (times a factor within ``1 ± noise``)."""
    rng = random.Random(seed)
    cost = CostModel(SMOLLM2_135M, UNBOUNDED, overhead)
    shapes: list[tuple[list[int], list[int]]] = []
    for context in (32, 256, 512):
        for batch in (1, 2, 8, 32):
            shapes.append(([1] * batch, [context + rng.randrange(4)] * batch))
            chunk = rng.choice((64, 256))
            shapes.append(([1] * batch + [chunk], [context] * batch + [chunk]))
    shapes += [([chunk], [chunk]) for chunk in (16, 64, 128, 256, 512)]
    shapes.append(([128, 128], [384, 128]))  # a later chunk of a long prompt beside a first one
    return [
        Measured(tuple(q), tuple(c), cost.step(q, c).seconds * (1 + rng.uniform(-noise, noise)))
        for q, c in shapes
    ]


def test_the_fit_recovers_the_constants_that_priced_the_steps():
    result = fit(designed_steps(CPU))
    for name in ("step", "seq", "token", "context", "pair"):
        assert getattr(result.overhead, name) == pytest.approx(getattr(CPU, name), rel=1e-6)
    assert result.worst_error < 1e-9


def test_with_noise_the_fit_prices_steps_within_the_noise():
    steps = designed_steps(CPU, noise=0.05, seed=3)
    result = fit(steps)
    assert result.median_error < 0.05 and result.worst_error < 0.12
    fitted = CostModel(SMOLLM2_135M, UNBOUNDED, result.overhead)
    truth = CostModel(SMOLLM2_135M, UNBOUNDED, CPU)
    for q, c in (([1] * 16, [300] * 16), ([200], [200]), ([1] * 8 + [100], [400] * 8 + [100])):
        assert fitted.step(q, c).seconds == pytest.approx(truth.step(q, c).seconds, rel=0.05)


def test_a_term_the_steps_price_below_zero_is_dropped_and_the_rest_refitted():
    no_pairs = Overhead(step=0.020, seq=0.0008, token=0.0012, context=2.5e-6)
    steps = designed_steps(no_pairs)
    shrunk = [Measured(s.query_lens, s.context_lens, s.seconds * (0.9 if len(s.query_lens) == 1
                                                                  and s.query_lens[0] >= 256 else 1.0))
              for s in steps]  # long prefills cheaper than linear: the pair term would go negative
    result = fit(shrunk)
    assert result.overhead.pair == 0.0
    assert all(getattr(result.overhead, name) >= 0 for name in ("step", "seq", "token", "context"))


def test_steps_that_cannot_tell_the_terms_apart_are_refused():
    decodes = [s for s in designed_steps(CPU) if set(s.query_lens) == {1}]
    with pytest.raises(ValueError, match=r"cannot tell the terms apart.*prefill chunks"):
        fit(decodes)  # a decode's query tokens are its sequences, its pairs its context
    with pytest.raises(ValueError, match="at least 5 measured steps, got 2"):
        fit(designed_steps(CPU)[:2])


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "seconds", "match"),
    [
        ((), (), 0.1, "at least one"),
        ((1, 1), (5,), 0.1, "as many query as context"),
        ((6,), (5,), 0.1, "query length <= context length"),
        ((1,), (5,), 0.0, "seconds > 0"),
        ((1,), (5,), math.nan, "seconds > 0"),
    ],
)
def test_a_measured_step_that_cannot_be_is_refused(query_lens, context_lens, seconds, match):
    with pytest.raises(ValueError, match=match):
        Measured(query_lens, context_lens, seconds)


def test_an_overhead_below_zero_is_refused():
    with pytest.raises(ValueError, match="overhead seq: expected seconds >= 0"):
        Overhead(seq=-1e-3)


def test_the_file_loads_as_the_cost_model_that_wrote_it(tmp_path):
    cost = CostModel(SMOLLM2_135M, UNBOUNDED, CPU)
    path = tmp_path / "costs.json"
    save(str(path), cost, {"steps": 3})
    again = load(str(path))
    assert again.shape == SMOLLM2_135M and again.overhead == CPU
    assert math.isinf(again.hardware.bandwidth) and math.isinf(again.hardware.flops)
    assert "bandwidth" not in json.loads(path.read_text())["hardware"]  # JSON has no infinity
    mixed = ([1] * 8 + [100], [200] * 8 + [100])
    assert again.step(*mixed).seconds == cost.step(*mixed).seconds
    gpu = PRESETS["llama-70b"]
    assert from_dict(as_dict(gpu)).step([1] * 256, [2000] * 256) == gpu.step([1] * 256, [2000] * 256)


def test_the_steps_a_file_carries_fit_again_together_with_others(tmp_path):
    steps = designed_steps(CPU, noise=0.05, seed=1)
    path = tmp_path / "earlier.json"
    save(str(path), CostModel(SMOLLM2_135M, UNBOUNDED, fit(steps).overhead),
         {"measured": [[list(s.query_lens), list(s.context_lens), s.seconds] for s in steps]})
    assert measured(str(path)) == steps
    later = designed_steps(CPU, noise=0.05, seed=2)
    together = fit(measured(str(path)) + later)
    assert together.steps == 2 * len(steps)
    assert together.median_error < 0.05
    save(str(path), CostModel(SMOLLM2_135M, UNBOUNDED, CPU))
    with pytest.raises(ValueError, match="no measured steps"):
        measured(str(path))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[]", "expected a 'ferry step costs 1' file"),
        ('{"format": "ferry step costs 1", "shape": {}}', "shape: Object missing required field `name`"),
        ('{"format": "ferry step costs 1", "shape": {"name": "x", "layers": "two"}}',
         r"shape: Expected `int`, got `str` - at `\$.layers`"),
        ("{", "not JSON"),
    ],
)
def test_a_file_that_is_not_step_costs_is_a_clear_error(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load(str(path))


def test_a_zero_overhead_leaves_the_roofline_and_decode_prices_the_same_float_as_a_step():
    plain = PRESETS["llama-70b"]
    assert plain.step([1] * 256, [2_000] * 256).overhead_seconds == 0.0
    priced = CostModel(SMOLLM2_135M, UNBOUNDED, CPU)
    contexts = [100, 250, 731]
    assert priced.decode_seconds(3, sum(contexts)) == priced.step([1] * 3, contexts).seconds
    expected = CPU.step + 3 * CPU.seq + 3 * CPU.token + 1081 * CPU.context + 1081 * CPU.pair
    assert priced.step([1] * 3, contexts).seconds == pytest.approx(expected)


def test_simulate_takes_the_costs_file_in_place_of_the_model_flags(tmp_path):
    path = tmp_path / "costs.json"
    save(str(path), CostModel(SMOLLM2_135M, UNBOUNDED, CPU))
    args = argparse.Namespace(cost=str(path), model="llama-70b", kv_gb=None)
    cost, kv_gib = cost_from_args(args)
    assert cost.overhead == CPU and cost.shape == SMOLLM2_135M
    assert kv_gib == pytest.approx(60e9 / 2**30)  # the smollm2-135m preset's KV, not the 70B's
