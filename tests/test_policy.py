"""SizeOrTimeout's decisions on hand-made queue states."""

import math

import pytest

from batcher.policy import Flush, Hold, QueueState, SizeOrTimeout, make_policy

policy = SizeOrTimeout(max_batch=50, max_wait=0.150)


@pytest.mark.parametrize(
    ("state", "decision"),
    [
        (QueueState(now=0.0, queued=0, oldest_arrival=None, idle_workers=8), Hold(queued=1)),
        (QueueState(now=0.0, queued=50, oldest_arrival=0.0, idle_workers=8), Flush(50, "size")),
        (QueueState(now=0.0, queued=120, oldest_arrival=0.0, idle_workers=1), Flush(50, "size")),
        (QueueState(now=0.1, queued=49, oldest_arrival=0.0, idle_workers=8), Hold(until=0.15, queued=50)),
        (QueueState(now=0.15, queued=49, oldest_arrival=0.0, idle_workers=8), Flush(49, "timeout")),
        (QueueState(now=0.2, queued=3, oldest_arrival=0.0, idle_workers=1), Flush(3, "timeout")),
        (QueueState(now=0.0, queued=50, oldest_arrival=0.0, idle_workers=0), Hold()),
        (QueueState(now=9.0, queued=3, oldest_arrival=0.0, idle_workers=0), Hold()),
        (QueueState(now=0.0, queued=3, oldest_arrival=0.0, idle_workers=0), Hold()),
    ],
)
def test_size_or_timeout(state, decision):
    assert policy.decide(state) == decision


def test_a_hold_with_no_timer_waits_for_a_worker_only():
    hold = policy.decide(QueueState(now=0.0, queued=10, oldest_arrival=0.0, idle_workers=0))
    assert (hold.until, hold.queued > 10**9) == (math.inf, True)


@pytest.mark.parametrize(("kwargs", "field"), [({"max_batch": 0}, "max_batch"), ({"max_wait": -1}, "max_wait")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SizeOrTimeout(**kwargs)


def test_policies_are_made_by_name_with_their_parameters():
    assert make_policy("size_or_timeout", max_batch=8, max_wait=0.05) == SizeOrTimeout(8, 0.05)
    with pytest.raises(ValueError, match="policy: expected one of \\['size_or_timeout'\\], got 'fifo'"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="policy size_or_timeout: .*max_size"):
        make_policy("size_or_timeout", max_size=8)
