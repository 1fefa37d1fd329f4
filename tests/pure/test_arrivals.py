"""Arrival processes and CSV traces: rates, shapes, seeds, and errors that name the line."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.sim.arrivals import Trace, bursty, piecewise, poisson, tier_mix, tier_picks


def test_poisson_offers_the_rate_within_the_window():
    times = poisson(2000.0, 10.0, seed=1)
    assert abs(len(times) - 20_000) < 4 * 20_000**0.5
    assert times[0] >= 0 and times[-1] < 10.0 and (np.diff(times) > 0).all()
    assert (poisson(2000.0, 10.0, seed=1) == times).all()


def test_piecewise_changes_rate_by_segment_and_allows_quiet_spells():
    times = piecewise([(10.0, 100.0), (5.0, 0.0), (5.0, 3000.0)], seed=2)
    counts = np.histogram(times, bins=[0, 10, 15, 20])[0]
    assert abs(counts[0] - 1000) < 150 and counts[1] == 0 and abs(counts[2] - 15000) < 600
    with pytest.raises(ValueError, match=r"segments\[1\] rate"):
        piecewise([(1.0, 1.0), (1.0, -5.0)])


def test_bursty_alternates_off_and_on_periods():
    times = bursty(base=10.0, peak=1000.0, on=1.0, off=4.0, duration=12.0, seed=3)
    counts = np.histogram(times, bins=np.arange(0, 13))[0]
    # off 0-4, on 4-5, off 5-9, on 9-10, off 10-12
    assert [c > 500 for c in counts] == [False] * 4 + [True] + [False] * 4 + [True] + [False] * 2


def test_tier_mix_keeps_its_draws_and_picks_are_indices():
    names = tier_mix(1000, {"paid": 0.2, "free": 0.8}, seed=5)
    picks = tier_picks(1000, {"paid": 0.2, "free": 0.8}, seed=5)
    assert names == [["paid", "free"][i] for i in picks]
    assert 150 < names.count("paid") < 250
    with pytest.raises(ValueError, match="tier mix"):
        tier_picks(3, {"paid": -1.0})


def test_a_trace_round_trips_through_csv(tmp_path):
    times = np.array([0.0, 0.25, 0.5])
    trace = Trace(times, np.array([0, 1, 0], dtype=np.int8), np.array([0.5, np.nan, 1.5]), ("paid", "free"))
    path = tmp_path / "trace.csv"
    trace.write(str(path))
    assert path.read_text().splitlines() == [
        "timestamp,tier,deadline",
        "0.000000,paid,0.500000",
        "0.250000,free,",
        "0.500000,paid,1.500000",
    ]
    again = Trace.read(str(path), ("paid", "free"))
    assert again.times.tolist() == times.tolist() and again.tier.tolist() == [0, 1, 0]
    assert np.array_equal(again.deadlines, trace.deadlines, equal_nan=True)


def test_a_read_trace_starts_at_zero_in_time_order_and_deadline_is_optional(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,tier\n1700000010.5,free\n1700000010.0,paid\n")
    trace = Trace.read(str(path), ("paid", "free"))
    assert trace.times.tolist() == [0.0, 0.5] and trace.tier.tolist() == [0, 1]
    assert np.isnan(trace.deadlines).all()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "timestamp,tier\n0.0,paid\n0.1,gold\n",
            r"trace.csv:3: tier: expected one of \['paid', 'free'\], got 'gold'",
        ),
        ("timestamp,tier,deadline\n0.0,paid,soon\n", r"trace.csv:2: could not convert"),
        ("time,tier\n0.0,paid\n", "expected a header with timestamp,tier"),
        ("timestamp,tier\n", "the trace has no arrival"),
    ],
)
def test_a_bad_trace_names_the_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Trace.read(str(path), ("paid", "free"))


def test_a_trace_of_shares_gives_each_arrival_a_budget():
    trace = Trace.of(np.array([0.0, 1.0]), {"paid": 1.0}, budget=0.5)
    assert trace.deadlines.tolist() == [0.5, 1.5] and trace.tiers == ("paid",)
