"""The measures L7 and L8 compute from a replay's outcomes: the real drain a Retry-After is held
against, the tokens still owed at a time, and when a threshold scaler fires."""

import numpy as np

from batcher.sim.continuous.replay import FINISHED, SHED, Outcomes
from batcher.sim.continuous.workload import Workload
from experiments import continuous_autoscale
from experiments.continuous_autoscale import fires, owed_tokens
from experiments.continuous_burst import real_drain


def outcomes(sent, first, end, outcome):
    out = Outcomes(len(sent))
    out.sent[:], out.first[:], out.end[:] = sent, first, end
    out.outcome[:] = outcome
    return out


def test_real_drain_is_the_newest_admitted_requests_first_token_after_the_refusal():
    out = outcomes(
        [0.0, 1.0, 2.0, 3.0, 0.5],
        [0.2, 4.0, np.nan, 5.0, np.nan],
        [1.0, 6.0, 2.0, 7.0, 0.5],
        [FINISHED, FINISHED, SHED, FINISHED, SHED],
    )
    drain = real_drain(out, np.argsort(out.sent, kind="stable"))
    assert drain[2] == 2.0  # shed at 2.0; the newest admitted (sent at 1.0) started at 4.0
    assert drain[4] == 0.2 - 0.5  # at 0.5 the one admitted at 0.0 had already started
    assert np.isnan(drain[[0, 1, 3]]).all()


def test_tokens_owed_count_waiting_prompts_and_answers_left():
    out = outcomes([0.0, 0.0], [1.0, 3.0], [3.0, 4.0], [FINISHED, FINISHED])
    none = np.full(2, -1)
    workload = Workload(
        np.zeros(2), np.zeros(2, dtype=np.int8), np.array([10, 20]), np.array([4, 6]), none, none, ("paid",)
    )
    owed = owed_tokens(out, workload, np.array([0.5, 2.0, 5.0]))
    assert owed[0] == 10 + 4 + 20 + 6  # neither started
    assert owed[1] == 2 + 20 + 6  # the first halfway through its answer, the second waiting
    assert owed[2] == 0


def test_a_scaler_fires_when_its_windowed_mean_passes_the_headroom(monkeypatch):
    monkeypatch.setattr(continuous_autoscale, "SHIFT", 4)
    monkeypatch.setattr(continuous_autoscale, "WINDOW", 2)
    assert fires(np.array([1.0, 1, 1, 1, 1, 1, 1])) == float("inf")
    assert fires(np.array([1.0, 1, 1, 1, 1, 2, 2])) == 1.0  # mean of (1, 2) = 1.5 > 1.3 one s after
