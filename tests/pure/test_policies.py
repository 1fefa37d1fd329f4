"""Every flush policy's decisions on hand-made queue states, and building policies by name."""

import math

import pytest

from batcher.fixed.policy import (
    AIMD,
    POLICIES,
    Flush,
    Hold,
    IdleAware,
    NoBatching,
    QueueState,
    SizeOrTimeout,
    SlackDriven,
    Static,
    make_policy,
)

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


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"max_batch": 0}, "max_batch"), ({"max_wait": -1}, "max_wait")]
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SizeOrTimeout(**kwargs)


def test_policies_are_made_by_name_with_their_parameters():
    assert make_policy("size_or_timeout", max_batch=8, max_wait=0.05) == SizeOrTimeout(8, 0.05)
    with pytest.raises(ValueError, match=r"policy: expected one of \['aimd', .*'static'\], got 'fifo'"):
        make_policy("fifo")
    with pytest.raises(ValueError, match=r"policy size_or_timeout: .*max_size"):
        make_policy("size_or_timeout", max_size=8)


def state(now=0.0, queued=0, oldest=None, idle=8, deadline=math.inf):
    return QueueState(now, queued, oldest if oldest is not None or not queued else 0.0, idle, deadline)


@pytest.mark.parametrize(
    ("given", "decision"),
    [
        (state(queued=0), Hold(queued=50)),
        (state(now=30.0, queued=49), Hold(queued=50)),  # no timeout: a lone request waits
        (state(queued=50), Flush(50, "size")),
        (state(queued=120, idle=1), Flush(50, "size")),
        (state(queued=50, idle=0), Hold()),
    ],
)
def test_static_waits_for_a_full_batch(given, decision):
    assert Static(50).decide(given) == decision


@pytest.mark.parametrize(
    ("given", "decision"),
    [
        (state(queued=0), Hold(queued=1)),
        (state(queued=1), Flush(1, "size")),
        (state(queued=30, idle=1), Flush(1, "size")),
        (state(queued=30, idle=0), Hold()),
    ],
)
def test_no_batching_sends_one_request_per_call(given, decision):
    assert NoBatching().decide(given) == decision


@pytest.mark.parametrize(
    ("given", "decision"),
    [
        (state(queued=0), Hold(queued=1)),
        # 3 wait and 6 GPUs are free: go now rather than in 150 ms
        (state(now=0.01, queued=3, idle=6), Flush(3, "idle")),
        (state(now=0.01, queued=3, idle=2), Flush(3, "idle")),
        # the last idle worker: wait for size or timeout, like SizeOrTimeout
        (state(now=0.01, queued=3, idle=1), Hold(until=0.15, queued=50)),
        (state(now=0.15, queued=3, idle=1), Flush(3, "timeout")),
        (state(now=0.01, queued=50, idle=1), Flush(50, "size")),
        (state(now=0.01, queued=80, idle=6), Flush(50, "size")),
        (state(now=0.5, queued=80, idle=0), Hold()),
    ],
)
def test_idle_aware_never_holds_while_spare_workers_idle(given, decision):
    assert IdleAware(50, 0.150, reserve=1).decide(given) == decision


def test_idle_aware_with_no_reserve_never_waits():
    assert IdleAware(reserve=0).decide(state(queued=1, idle=1)) == Flush(1, "idle")


@pytest.mark.parametrize(
    ("given", "decision"),
    [
        (state(queued=0), Hold(queued=1)),
        # deadline at 0.5: the batch must leave by 0.5 - 0.2 - 0.02 = 0.28
        (state(now=0.1, queued=10, deadline=0.5), Hold(until=pytest.approx(0.28), queued=50)),
        (state(now=0.28, queued=10, deadline=0.5), Flush(10, "slack")),
        (state(now=0.3, queued=70, deadline=0.5), Flush(50, "size")),
        (state(now=0.1, queued=50, deadline=0.5), Flush(50, "size")),
        (state(now=0.3, queued=10, idle=0, deadline=0.5), Hold()),
        (state(now=5.0, queued=10), Hold(until=math.inf, queued=50)),  # no deadline: wait for a full batch
    ],
)
def test_slack_driven_waits_as_long_as_the_tightest_deadline_allows(given, decision):
    assert SlackDriven(50, service_time=0.2, margin=0.02).decide(given) == decision


def test_slack_driven_drops_work_with_less_than_one_service_time_left():
    assert SlackDriven(service_time=0.2).drop_before == 0.2
    assert not hasattr(SizeOrTimeout(), "drop_before")


def test_aimd_grows_by_a_step_per_call_under_target_and_backs_off_above_it():
    policy = AIMD(max_batch=8, target=0.25, step=2, backoff=0.5, start=1)
    assert policy.decide(state(queued=5, idle=1)) == Flush(1, "size")
    limits = []
    for size, seconds in [
        (1, 0.2),
        (3, 0.2),
        (2, 0.2),
        (3, 0.2),
        (5, 0.2),
        (7, 0.2),
        (8, 0.2),
        (8, 0.3),
        (1, 0.3),
    ]:
        policy.observe(size, seconds)
        limits.append(policy.limit)
    assert limits == [3, 5, 7, 8, 8, 8, 8, 4, 2]  # never outside 1..max_batch
    assert policy.decide(state(queued=5, idle=1)) == Flush(2, "size")
    assert policy.decide(state(queued=1, idle=1)) == Flush(1, "timeout")  # max_wait 0: no waiting
    for _ in range(5):
        policy.observe(1, 1.0)
    assert policy.limit == 1


def test_aimd_settles_under_the_size_whose_call_meets_the_target():
    policy = AIMD(max_batch=50, target=0.2)
    for _ in range(200):  # service time 0.1 + 0.005 s per input: 20 inputs take exactly 0.2 s
        policy.observe(policy.limit, 0.1 + 0.005 * policy.limit)
    assert 18 <= policy.limit <= 21


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("static", {"max_batch": 0}, "max_batch"),
        ("idle_aware", {"max_wait": -0.1}, "max_wait"),
        ("idle_aware", {"reserve": -1}, "reserve"),
        ("slack_driven", {"service_time": math.inf}, "service_time"),
        ("slack_driven", {"margin": -1}, "margin"),
        ("aimd", {"target": 0}, "target"),
        ("aimd", {"backoff": 1.0}, "backoff"),
        ("aimd", {"step": 0}, "step"),
        ("aimd", {"start": 51}, "start"),
        ("no_batching", {"max_batch": 4}, "max_batch"),
    ],
)
def test_every_policy_names_its_bad_field(name, params, field):
    with pytest.raises(ValueError, match=field):
        make_policy(name, **params)


def test_every_policy_is_made_by_name_with_defaults():
    assert sorted(POLICIES) == [
        "aimd",
        "idle_aware",
        "no_batching",
        "size_or_timeout",
        "slack_driven",
        "static",
    ]
    for name in POLICIES:
        assert make_policy(name).decide(state(queued=0)) in (Hold(queued=1), Hold(queued=50))
    assert make_policy("idle_aware", max_batch=8, reserve=2) == IdleAware(8, 0.15, 2)
