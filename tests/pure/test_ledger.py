"""The ledger: charge at admission, refund and bill what was delivered, count it in metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.accounting.ledger import Entry, Ledger, Outcome
from gateway.accounting.limiter import MemoryLimiter
from gateway.accounting.ratelimit import Limits
from gateway.accounting.usage import UsageLog, read_usage
from gateway.metrics import Metrics
from gateway.wire.api import InvalidRequest, RateLimited

PLAN = Limits(tokens_per_minute=1000)


def entry(request_id: str, input_tokens: int = 100, max_tokens: int = 400) -> Entry:
    return Entry(
        request_id, "acme", "k-1234", "paid", "m@1", PLAN, input_tokens, max_tokens, time.monotonic()
    )


def samples(metrics: Metrics) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }


@pytest.fixture
def ledger(tmp_path):
    usage = UsageLog(str(tmp_path / "usage.sqlite"))
    yield Ledger(MemoryLimiter(), usage, Metrics())
    usage.close()


def test_delivered_tokens_are_billed_and_the_rest_refunded(ledger):
    async def scenario():
        first = entry("r1")
        await ledger.charge(first)  # 500 of 1000
        first.delivered(1)
        first.delivered(29)
        first.status, first.stop_reason = 200, "end_turn"
        await ledger.close(first)  # 370 unused come back: 130 stay charged
        second = entry("r2", input_tokens=470, max_tokens=400)  # 870 <= 1000 - 130
        await ledger.charge(second)
        with pytest.raises(RateLimited) as limited:
            await ledger.charge(entry("r3", input_tokens=1, max_tokens=1))
        return limited.value

    limited = asyncio.run(scenario())
    assert limited.retry_after == pytest.approx(0.12, abs=0.01)  # 2 tokens short at 1000/60 per s
    ledger.usage.close()
    (record,) = read_usage(ledger.usage.path)
    assert (record.request_id, record.output_tokens, record.status, record.key_id) == (
        "r1",
        30,
        200,
        "k-1234",
    )
    assert record.ttft_s is not None and record.total_s >= record.ttft_s
    found = samples(ledger.metrics)
    assert found[("ferry_requests_total", (("model", "m@1"), ("status", "200"), ("tier", "paid")))] == 1
    assert found[("ferry_time_per_output_token_seconds_count", (("model", "m@1"), ("tier", "paid")))] == 1
    rejects = (
        "ferry_admission_rejects_total",
        (("model", "m@1"), ("reason", "rate_limit"), ("tier", "paid")),
    )
    assert found[rejects] == 1


def test_a_request_that_never_reached_a_model_gets_everything_back(ledger):
    async def scenario():
        shed = entry("r1", input_tokens=500, max_tokens=500)
        await ledger.charge(shed)
        shed.status, shed.outcome = 529, Outcome.SHED
        await ledger.close(shed)
        await ledger.charge(entry("r2", input_tokens=500, max_tokens=500))  # the whole minute again

    asyncio.run(scenario())
    found = samples(ledger.metrics)
    assert (
        found[("ferry_admission_rejects_total", (("model", "m@1"), ("reason", "shed"), ("tier", "paid")))]
        == 1
    )


def test_a_charge_bigger_than_the_plan_is_a_400_naming_the_limit(ledger):
    with pytest.raises(InvalidRequest, match="1001 is more than this key's 1000 tokens per minute"):
        asyncio.run(ledger.charge(entry("r1", input_tokens=1, max_tokens=1000)))


def test_a_key_without_limits_is_never_charged(ledger):
    async def scenario():
        free_for_all = Entry("r1", "acme", "k-9", "paid", "m@1", Limits(), 10**9, 10**9, time.monotonic())
        await ledger.charge(free_for_all)
        return free_for_all.charged

    assert asyncio.run(scenario()) is False


def test_each_named_tenant_has_its_own_series_and_every_other_tenant_counts_as_other(ledger):
    ledger.metrics.name_tenants(["acme", "acme", "globex"])

    async def scenario():
        for request_id, tenant, status, outcome, tokens in [
            ("r1", "acme", 200, Outcome.COMPLETED, 30), ("r2", "acme", 529, Outcome.SHED, 0),
            ("r3", "stranger", 200, Outcome.COMPLETED, 5), ("r4", "intruder", 200, Outcome.COMPLETED, 7),
        ]:
            account = entry(request_id, input_tokens=100)
            account.tenant, account.status, account.outcome = tenant, status, outcome
            if tokens:
                account.delivered(tokens)
            await ledger.close(account)

    asyncio.run(scenario())
    found = samples(ledger.metrics)

    def tenant(name, tenant, **labels):
        return found.get((name, tuple(sorted({"model": "m@1", "tenant": tenant, **labels}.items()))))

    assert tenant("ferry_tenant_requests_total", "acme", outcome="completed") == 1
    assert tenant("ferry_tenant_requests_total", "acme", outcome="shed") == 1  # a reject, by tenant
    assert tenant("ferry_tenant_tokens_total", "acme", kind="input") == 100  # the shed one read nothing
    assert tenant("ferry_tenant_tokens_total", "acme", kind="output") == 30
    assert tenant("ferry_tenant_requests_total", "other", outcome="completed") == 2
    assert tenant("ferry_tenant_tokens_total", "other", kind="output") == 12
    assert tenant("ferry_tenant_ttft_seconds_count", "other") == 2
    assert {labels for name, labels in found if name == "ferry_tenant_requests_total"} == {
        (("model", "m@1"), ("outcome", outcome), ("tenant", name))
        for name, outcome in [("acme", "completed"), ("acme", "shed"), ("other", "completed")]}
