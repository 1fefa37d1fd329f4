"""The batching policies of ``experiments/continuous_drive.py`` over one engine in virtual time: none
serves one request at a time, static starts a batch only once the one before has drained,
continuous starts an arrival at the next step; and the capacity search stops at the first miss."""

import numpy as np

from experiments.continuous_common import Replica
from experiments.continuous_drive import CONTINUOUS, NONE, drive, highest, refine, static, sweep
from workers.engine.cost_model import PRESETS

SMALL = PRESETS["smollm2-135m"]


def serve(policy, times=(0.0, 0.0, 0.001), answers=(50, 5, 5)):
    replica = Replica(SMALL, num_blocks=512)
    return drive(replica, np.array(times), [32] * len(times), list(answers), policy)


def test_none_serves_one_at_a_time():
    served = serve(NONE)
    assert (served.tokens == [50, 5, 5]).all()
    assert served.first[1] > served.end[0] and served.first[2] > served.end[1]


def test_static_waits_for_the_batch_to_drain():
    served = serve(static(2))
    assert served.first[1] == served.first[0]  # the two at 0 start together
    assert served.end[1] < served.end[0]  # the short one leaves early...
    assert served.first[2] > served.end[0]  # ...but the third waits for the long one


def test_continuous_starts_arrivals_at_once():
    served = serve(CONTINUOUS)
    assert served.first[2] < served.end[0]  # it joins while the long one decodes
    assert np.isfinite(served.end).all() and served.seconds == served.end.max()


def test_idle_engine_jumps_to_the_next_arrival():
    served = serve(CONTINUOUS, times=(0.0, 100.0), answers=(3, 3))
    assert served.end[0] < 1.0 and 100.0 < served.first[1] < 101.0


def test_sweep_stops_at_the_first_failure_and_highest_needs_every_row_below():
    runs = []

    def ok(row):
        return row["ok"]

    rows = sweep(lambda rate: runs.append(rate) or {"req/s": rate, "ok": rate < 3}, (1, 2, 3, 4), ok)
    assert runs == [1, 2, 3] and [r["req/s"] for r in rows] == [1, 2, 3]
    assert highest(rows, ok) == 2
    assert highest([{"req/s": 1, "ok": False}, {"req/s": 2, "ok": True}], ok) == 0


def test_refine_bisects_between_the_last_rate_met_and_the_first_failed():
    def run(rate):
        return {"req/s": rate, "ok": rate < 2.6}

    def ok(row):
        return row["ok"]

    rows = sweep(run, (1, 2, 3, 4), ok)
    assert refine(run, rows, ok, times=2) == 2.5  # 2.5 meets, then 2.75 fails
    assert refine(run, sweep(run, (1, 2), ok), ok) == 2  # nothing failed: nothing to narrow
