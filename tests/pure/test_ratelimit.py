"""The per-key limiter: bucket arithmetic under MockClock, exact Retry-After, refunds."""

import math

import pytest
from trio.testing import MockClock

from gateway.accounting.limiter import LeasedLimiter, MemoryLimiter
from gateway.accounting.ratelimit import Limits
from gateway.wire import limit_headers

PLAN = Limits(tokens_per_minute=600, requests_per_minute=5)  # refills 10 tokens/s, 1 request/12 s


@pytest.fixture
def clock():
    return MockClock()


@pytest.fixture
def limiter(clock):
    return MemoryLimiter(clock=clock.current_time)


async def test_a_charge_within_the_limit_is_admitted_and_drains_the_bucket(limiter):
    assert (await limiter.acquire("k", PLAN, 400)).admitted
    verdict = await limiter.acquire("k", PLAN, 201)
    assert not verdict.admitted
    assert verdict.retry_after == pytest.approx(0.1)  # 1 token short at 10 tokens/s


async def test_retry_after_is_exactly_when_the_same_charge_fits(limiter, clock):
    assert (await limiter.acquire("k", PLAN, 600)).admitted
    verdict = await limiter.acquire("k", PLAN, 100)
    assert verdict.retry_after == pytest.approx(10.0)
    clock.jump(9.99)
    assert not (await limiter.acquire("k", PLAN, 100)).admitted
    clock.jump(0.01)
    assert (await limiter.acquire("k", PLAN, 100)).admitted


async def test_a_refused_charge_takes_nothing_from_any_bucket(limiter, clock):
    for _ in range(5):
        assert (await limiter.acquire("k", PLAN, 10)).admitted
    refused = await limiter.acquire("k", PLAN, 10)
    assert refused.retry_after == pytest.approx(12.0)  # the request bucket is the one short
    clock.jump(12.0)
    assert (await limiter.acquire("k", PLAN, 550)).admitted  # 550 tokens were left untouched


async def test_the_unused_part_is_refunded_and_usable_at_once(limiter):
    assert (await limiter.acquire("k", PLAN, 500)).admitted
    await limiter.refund("k", PLAN, 300)
    assert (await limiter.acquire("k", PLAN, 400)).admitted


async def test_a_refund_never_overflows_a_bucket(limiter):
    await limiter.refund("k", PLAN, 10_000)
    assert (await limiter.acquire("k", PLAN, 600)).admitted
    assert not (await limiter.acquire("k", PLAN, 1)).admitted


async def test_a_charge_larger_than_a_minute_of_budget_can_never_fit(limiter):
    verdict = await limiter.acquire("k", PLAN, 601)
    assert verdict.never and math.isinf(verdict.retry_after)
    assert (await limiter.acquire("k", PLAN, 600)).admitted  # and it took nothing


async def test_keys_have_separate_buckets_and_unlimited_plans_always_fit(limiter):
    assert (await limiter.acquire("a", PLAN, 600)).admitted
    assert (await limiter.acquire("b", PLAN, 600)).admitted
    unlimited = Limits()
    assert all([(await limiter.acquire("c", unlimited, 10**12)).admitted for _ in range(100)])


async def test_a_leased_slice_is_served_locally_then_renewed(clock):
    shared = MemoryLimiter(clock=clock.current_time)
    leased = LeasedLimiter(shared, share=0.5, ttl=1.0, clock=clock.current_time)
    plan = Limits(tokens_per_minute=600)
    assert (await leased.acquire("k", plan, 100)).admitted  # leases 300 from the shared bucket
    assert not (await shared.acquire("k", plan, 301)).admitted  # 300 left there
    assert (await leased.acquire("k", plan, 200)).admitted  # served from the lease
    clock.jump(1.0)  # the lease expires: nothing was left in it
    assert (await leased.acquire("k", plan, 100)).admitted


async def test_a_lease_never_admits_more_than_the_shared_limit(clock):
    shared = MemoryLimiter(clock=clock.current_time)
    gateways = [LeasedLimiter(shared, share=0.3, clock=clock.current_time) for _ in range(3)]
    plan = Limits(tokens_per_minute=1000)
    admitted = 0
    for round_ in range(200):
        gateway = gateways[round_ % 3]
        if (await gateway.acquire("k", plan, 7)).admitted:
            admitted += 7
    assert admitted <= 1000


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"tokens_per_minute": 0}, "tokens_per_minute"), ({"requests_per_minute": 1.5}, "requests_per_minute")],
)
def test_bad_limits_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Limits(**kwargs)


async def test_a_verdict_says_the_levels_the_headers_show():
    limiter = MemoryLimiter(clock=lambda: 0.0)
    plan = Limits(tokens_per_minute=600, requests_per_minute=10)
    assert (await limiter.acquire("k", plan, 100)).levels == (500.0, 9.0)
    refused = await limiter.acquire("k", plan, 501)
    assert not refused.admitted and refused.levels == (500.0, 9.0)  # nothing taken
    assert (await limiter.acquire("u", Limits(requests_per_minute=5), 10**9)).levels == (math.inf, 4.0)


def test_each_api_words_the_limits_its_own_way():
    plan, levels, now = (600, None), (450.6, math.inf), 1_700_000_000.0
    assert limit_headers.anthropic(plan, levels, now) == {
        "anthropic-ratelimit-tokens-limit": "600",
        "anthropic-ratelimit-tokens-remaining": "450",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:35Z",  # 149.4 tokens at 10/s: 15 s, rounded up
    }
    assert limit_headers.openai((600, 10), (599.0, 9.5), now) == {
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "599",
        "x-ratelimit-reset-tokens": "100ms", "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9", "x-ratelimit-reset-requests": "3s",
    }
    leased = limit_headers.openai((600, None), None)  # a lease's slice: the limits alone
    assert leased == {"x-ratelimit-limit-tokens": "600"}
