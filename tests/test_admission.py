"""Overload admission decisions on hand-made loads: paid budget, free shed first, Retry-After."""

import pytest

from batcher.admission import Admission, Load, admit, budget

BUDGETS = (1.0, 0.3)  # paid may wait 1 s, free 300 ms
PAID, FREE = 0, 1


@pytest.mark.parametrize(
    ("queued", "tier", "verdict"),
    [
        ((0, 0), PAID, Admission(True, 0.0, 1.0)),
        ((0, 0), FREE, Admission(True, 0.0, 0.3)),
        ((0, 200), FREE, Admission(True, 0.2, 0.3)),
        ((0, 400), FREE, Admission(False, 0.4, 0.3, retry_after=0.4)),
        ((0, 400), PAID, Admission(True, 0.0, 1.0)),  # free's queue is not ahead of paid
        ((500, 0), PAID, Admission(True, 0.5, 1.0)),
        # paid uses half its budget, so free's budget halves: 150 ms, and 500 paid are ahead
        ((500, 0), FREE, Admission(False, 0.5, 0.15, retry_after=0.5)),
        ((100, 100), FREE, Admission(True, 0.2, pytest.approx(0.27))),
        ((1000, 0), PAID, Admission(True, 1.0, 1.0)),
        ((1000, 0), FREE, Admission(False, 1.0, 0.0, retry_after=1.0)),
        ((1500, 0), PAID, Admission(False, 1.5, 1.0, retry_after=1.5)),
    ],
)
def test_admission_at_a_drain_rate_of_1000_per_second(queued, tier, verdict):
    assert admit(Load(queued, drain_rate=1000.0), tier, BUDGETS) == verdict


def test_free_budget_shrinks_with_paid_pressure_before_paid_is_touched():
    budgets = [budget(Load((paid, 0), 1000.0), FREE, BUDGETS) for paid in (0, 250, 500, 750, 1000, 2000)]
    assert budgets == pytest.approx([0.3, 0.225, 0.15, 0.075, 0.0, 0.0])


def test_a_backend_that_has_not_measured_its_drain_rate_admits_everything():
    assert admit(Load((10_000, 10_000), drain_rate=0.0), FREE, BUDGETS).admitted


def test_an_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="tier 2 of 2 budgets"):
        admit(Load((0, 0), 1000.0), 2, BUDGETS)
