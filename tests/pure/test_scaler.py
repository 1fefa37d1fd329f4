"""The scaler's pure core: up fast on the top tier's predicted wait or on demand, down only after
``scale_down_after`` of spare capacity and never below ``min_workers``, to zero only after
``idle_after`` without work; the steps (warm workers promoted before any start), which workers
leave (a busy one last, to drain), and a cold start's wait-or-come-back verdict."""

from __future__ import annotations

import pytest

from batcher.core.config import ScalerConfig
from batcher.core.scaler import Fleet, Scaler, Signals, Steps, cold_start, leaving, plan
from batcher.fixed.config import FixedModelConfig

CALM = Signals(wait=0.0, budget=1.0, rate=10.0, per_worker=20.0, queued=0, busy=1)
"""10 requests/s against 20 a worker: one worker is enough."""
BACKLOG = Signals(wait=0.8, budget=1.0, rate=20.0, per_worker=20.0, queued=40, busy=1)
"""The top tier would wait 0.8 s of its 1 s budget."""
BURST = Signals(wait=0.9, budget=1.0, rate=60.0, per_worker=20.0, queued=90, busy=4)
"""60 requests/s: four workers at 80% (three would run at 100%)."""
IDLE = Signals(wait=0.0, budget=1.0, rate=0.0, per_worker=20.0, queued=0, busy=0)


def scaler(low: int = 1, high: int = 4, down: float = 30.0, idle: float = 120.0) -> Scaler:
    return Scaler(ScalerConfig(low, high, scale_down_after=down, idle_after=idle))


def test_a_backlog_scales_up_at_once_by_what_the_rate_needs_within_max():
    up = scaler().decide(BACKLOG, 1, now=0.0)
    assert (up.serving, up.direction, up.cause) == (2, "up", "wait")  # 20/s needs 2 at 80%
    assert "predicted wait 0.800s is over 50% of its 1s budget" in up.reason
    assert scaler().decide(BURST, 1, now=0.0).serving == 4
    assert scaler(high=3).decide(BURST, 1, now=0.0).serving == 3
    assert scaler(high=3).decide(BURST, 3, now=0.0).direction == "hold"


def test_capacity_is_taken_away_only_after_the_delay_of_spare_capacity():
    s = scaler(down=30.0)
    decisions = [s.decide(CALM, 4, now=t) for t in (0.0, 10.0, 29.9)]
    assert [d.direction for d in decisions] == ["hold"] * 3
    down = s.decide(CALM, 4, now=30.0)
    assert (down.serving, down.direction, down.cause) == (1, "down", "spare")
    assert s.decide(CALM, 1, now=31.0).direction == "hold"


def test_a_moment_of_backlog_restarts_the_delay():
    s = scaler(down=30.0)
    s.decide(CALM, 4, now=0.0)
    s.decide(BURST, 4, now=20.0)  # at max: holds, and capacity is not spare
    assert [s.decide(CALM, 4, now=t).direction for t in (40.0, 69.9)] == ["hold", "hold"]
    assert s.decide(CALM, 4, now=70.0).serving == 1  # spare again since t = 40


def test_never_below_min_workers_and_up_to_it_when_below():
    s = scaler(low=2, down=0.0)
    assert s.decide(IDLE, 4, now=0.0).serving == 2
    assert s.decide(IDLE, 2, now=1000.0).direction == "hold"
    up = s.decide(IDLE, 1, now=1001.0)  # a worker that failed to start left the fleet short
    assert (up.serving, up.cause) == (2, "min")


def test_the_last_worker_stops_only_after_idle_after_without_work_and_only_at_min_zero():
    s = scaler(low=0, down=0.0, idle=120.0)
    assert s.decide(IDLE, 1, now=0.0).direction == "hold"
    assert s.decide(IDLE, 1, now=119.0).direction == "hold"
    stop = s.decide(IDLE, 1, now=120.0)
    assert (stop.serving, stop.direction, stop.cause) == (0, "down", "idle")
    busy = scaler(low=0, down=0.0, idle=120.0)
    busy.decide(IDLE, 1, now=0.0)
    busy.decide(CALM, 1, now=100.0)  # work in flight: idle again from here
    assert busy.decide(IDLE, 1, now=200.0).direction == "hold"
    starting = scaler(low=0, down=0.0, idle=120.0)
    assert starting.decide(IDLE, 1, now=0.0, starting=1).direction == "hold"
    assert starting.decide(IDLE, 1, now=200.0, starting=1).direction == "hold"  # a start is not idleness
    assert scaler(low=1, down=0.0, idle=0.0).decide(IDLE, 1, now=1e6).direction == "hold"


def test_work_for_a_version_with_no_worker_starts_one():
    cold = scaler(low=0).decide(Signals(0.0, 1.0, 0.0, 0.0, queued=1), 0, now=5.0)
    assert (cold.serving, cold.direction, cold.cause) == (1, "up", "cold")
    assert scaler(low=0).decide(IDLE, 0, now=5.0).direction == "hold"


def test_a_decision_up_promotes_warm_workers_before_starting_any_and_refills_the_warm_pool():
    assert plan(3, Fleet(serving=1, warm=1), warm_workers=1) == Steps(promote=1, start=1, start_warm=1)
    assert plan(2, Fleet(serving=1, warm=2), warm_workers=2) == Steps(promote=1, start_warm=1)
    assert plan(2, Fleet(serving=1, starting=1, warming=1), warm_workers=1) == Steps()
    assert plan(1, Fleet(serving=3, starting=1), warm_workers=0) == Steps(retire=3)
    # a warm worker ready while one still starts: it serves now, the start is called off
    assert plan(3, Fleet(serving=2, starting=1, warm=1), warm_workers=1) == Steps(promote=1, start_warm=1,
                                                                                  retire=1)


def test_starting_workers_leave_first_then_idle_ones_highest_first_and_busy_ones_last():
    states = [(0, "busy"), (1, "idle"), (2, "busy"), (3, "idle"), (4, "starting")]
    assert leaving(states, 3) == [4, 3, 1]
    assert leaving(states, 5) == [4, 3, 1, 2, 0]


@pytest.mark.parametrize(("start", "started_for", "budget", "verdict"), [
    (8.0, 0.0, 10.0, (True, 8.0)),    # the start fits the budget: wait for it
    (8.0, 0.0, 5.0, (False, 8.0)),    # it does not: come back in 8 s
    (8.0, 4.0, 5.0, (True, 4.0)),     # a start already under way for 4 s: 4 s left fit
])
def test_a_cold_start_waits_only_when_the_measured_start_fits_the_budget(start, started_for, budget, verdict):
    decided = cold_start(start, started_for, budget)
    assert (decided.wait, decided.ready_in) == verdict


def fixed(**keys) -> FixedModelConfig:
    return FixedModelConfig(name="m@1", worker=["echo"], **keys)


def test_the_keys_default_to_workers_and_a_range_opens_slots_for_max_and_warm():
    assert not fixed(workers=3).scaling(3).elastic and fixed(workers=3).pool_config().workers == 3
    ranged = fixed(workers=2, min_workers=1, max_workers=4, warm_workers=1)
    assert (ranged.pool_config().workers, ranged.pool_config().initial) == (5, 1)
    assert fixed(workers=8, min_workers=2).scaling(8).max_workers == 8


@pytest.mark.parametrize(("keys", "message"), [
    ({"min_workers": 3, "max_workers": 2}, "max_workers: expected max(1, min_workers = 3)..4096, got 2"),
    ({"min_workers": -1}, "min_workers: expected 0..4096, got -1"),
    ({"warm_workers": -1}, "warm_workers: expected 0..4096, got -1"),
    ({"scale_down_after_s": -1.0}, "scale_down_after_s: expected a finite number of seconds >= 0"),
    ({"idle_after_s": float("inf")}, "idle_after_s: expected a finite number of seconds >= 0"),
])
def test_bad_scaler_keys_are_refused_with_the_field_named(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fixed(**keys)
