"""Two ``ferry serve`` processes sharing one real Redis (where their limits live): an
Idempotency-Key retried on the other gateway, while the first runs or after it answered, gets
the first answer; the request runs once and is billed once."""

from __future__ import annotations

import concurrent.futures
import uuid

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import PAID, Gateway, message

CONFIG = f"""
[server]
port = 0

[[tiers]]
name = "paid"
wait_budget_ms = 10000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"

[[models]]
name = "sleepy@1"
workers = 1
worker = ["sleep", "--latency-ms", "300"]
max_wait_ms = 1
"""


def test_a_retry_on_the_other_gateway_gets_the_first_answer_and_runs_nothing(tmp_path, redis_url):
    shared = CONFIG + f'[limits]\nstore = "redis"\nredis_url = "{redis_url}"\n'
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = Gateway(tmp_path / "a", shared), Gateway(tmp_path / "b", shared)
    key = {"Idempotency-Key": f"idem-{uuid.uuid4()}"}
    body = message("only once", model="sleepy@1")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # two on each while one runs
            answers = list(pool.map(lambda gateway: gateway.request("POST", "/v1/messages", body, key),
                                    [first, second, first, second]))
        later = second.request("POST", "/v1/messages", body, key)  # after it answered
        other = first.request("POST", "/v1/messages", message("another body", model="sleepy@1"), key)
        calls = [g.ready()["models"]["sleepy@1"]["calls"] for g in (first, second)]
    finally:
        assert first.stop() == 0 and second.stop() == 0
    assert [a[0] for a in answers] == [200] * 4 and later[0] == 200
    assert len({a[2]["id"] for a in [*answers, later]}) == 1  # one answer, five times
    assert sum(calls) == 1  # one worker call over both gateways
    assert other[0] == 400 and "different request body" in other[2]["error"]["message"]
    records = [r for d in ("a", "b") for r in read_usage(str(tmp_path / d / "usage.sqlite"))]
    assert [r.request_id for r in records] == [answers[0][2]["id"]]  # billed once
