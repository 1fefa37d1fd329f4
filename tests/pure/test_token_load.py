"""Admission in tokens, pure: the continuous mode's Load against the one shedding rule, and the
token rate measured from an engine's counters."""

from __future__ import annotations

import math

import pytest

from batcher.continuous.token_load import TokenLoad, TokenRate
from batcher.core.admission import AdmissionControl
from batcher.core.errors import Shed


def test_the_wait_is_the_tokens_queued_in_the_tier_and_above_at_the_rate_left_by_higher_arrivals():
    load = TokenLoad(queued=(400.0, 600.0), rate=1000.0, arrivals=(500.0, 0.0))
    assert load.wait(0) == pytest.approx(0.4)
    assert load.wait(1) == pytest.approx(1000 / 500)  # paid arrivals take half the rate
    assert load.wait(1, cost=10_000) == load.wait(1)  # its own cost is what the next ones wait for
    assert TokenLoad((5.0, 5.0), 1000.0, (1000.0, 0.0)).wait(1) == math.inf
    assert load.pressure(0) == load.wait(0)


def test_nothing_queued_or_nothing_measured_is_no_wait_and_admits():
    assert TokenLoad((0.0, 0.0), 1000.0).wait(1) == 0.0
    unmeasured = TokenLoad((1e9, 1e9), 0.0)
    assert not unmeasured.measured and unmeasured.wait(1) == 0.0
    assert AdmissionControl((1.0, 0.3)).shed(unmeasured, 1, 0.0, cost=1e6) is None


def test_free_is_shed_first_then_paid_with_a_retry_after_from_the_queue_and_the_job_cost():
    control = AdmissionControl((1.0, 0.3))
    busy = TokenLoad(queued=(250.0, 0.0), rate=1000.0)  # paid's backlog: a quarter of its budget
    assert control.shed(busy, 0, now=0.0, cost=100) is None
    shed = control.shed(busy, 1, now=0.0, cost=100)  # free's budget: 0.3 x (1 - 0.25) = 0.225 s
    assert isinstance(shed, Shed) and "over the budget of 0.225s" in str(shed)
    assert shed.retry_after == pytest.approx(0.25)  # the paid request admitted at 0 is due then
    full = TokenLoad(queued=(1200.0, 0.0), rate=1000.0)
    assert isinstance(control.shed(full, 0, now=0.0, cost=100), Shed)
    cheap = AdmissionControl((1.0, 0.3)).shed(TokenLoad((0.0, 400.0), 1000.0), 1, 0.0, cost=3000)
    assert cheap.retry_after == pytest.approx(3.0)  # never less than its own share of the rate


def test_a_tier_whose_drain_the_higher_tiers_take_whole_is_told_so_not_an_infinite_wait():
    starved = TokenLoad(queued=(0.0, 50.0), rate=1000.0, arrivals=(1000.0, 0.0))
    shed = AdmissionControl((1.0, 0.3)).shed(starved, 1, 0.0, cost=10)
    assert isinstance(shed, Shed) and "inf" not in str(shed)
    assert "no capacity is left for this tier" in str(shed) and shed.retry_after > 0


def test_the_rate_averages_busy_intervals_only_and_survives_a_restart_of_the_counter():
    rate = TokenRate(tau=1.0)
    rate.update(0.0, 0)
    rate.update(0.5, 500)
    assert rate.value == pytest.approx(1000.0)  # the first interval sets it
    rate.update(1.0, 600, busy=False)  # an idle engine: its low rate says nothing of capacity
    assert rate.value == pytest.approx(1000.0)
    rate.update(2.0, 2600)  # 2000 tokens/s for a second: weight 1 - e^-1
    assert rate.value == pytest.approx(1000 + (1 - math.exp(-1)) * 1000)
    rate.restart()  # a new engine counts from 0 again
    before = rate.value
    rate.update(2.2, 10)  # a baseline, not 10 - 2600 tokens
    assert rate.value == before
    rate.update(2.4, 210)
    assert rate.value == pytest.approx(before + (1 - math.exp(-0.2)) * (1000 - before))
