"""Admission, idempotency, usage, safety and metrics over real HTTP against real `ferry serve`s."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import stat
import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import CONFIG, PAID, Gateway, message
from tests.support.waiting import until

LIMITED = "sk-test-limited-0003"


def config(state_dir, limits: str = "", tokens_per_minute: int = 1000) -> str:
    """The gateway tests' config, with a state directory, a blocklist and a rate-limited key."""
    return CONFIG + f"""
[state]
dir = "{state_dir}"
[safety]
blocklist = ["forbidden", "sacred"]
{limits}

[[keys]]
key = "{LIMITED}"
tenant = "small"
tier = "paid"
tokens_per_minute = {tokens_per_minute}
"""


@pytest.fixture
def state(tmp_path):
    directory = tmp_path / "state"
    directory.mkdir()
    return directory


@pytest.fixture
def gateway(tmp_path, state):
    server = Gateway(tmp_path, config(state))
    yield server
    server.stop()


def test_a_key_over_its_token_limit_gets_429_with_when_to_retry(gateway):
    first_body = message("x" * 90, model="sleepy", max_tokens=500)
    began = time.monotonic()
    status, _, first = gateway.request("POST", "/v1/messages", first_body, key=LIMITED)
    assert status == 200
    usage = first["usage"]  # charged input + 500, then refunded the 500 - output it did not use
    left = 1000 - usage["input_tokens"] - usage["output_tokens"]
    second = message("y" * 90, model="sleepy", max_tokens=900)
    status, headers, answer = gateway.request("POST", "/v1/messages", second, key=LIMITED)
    elapsed_ms = (time.monotonic() - began) * 1000
    assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    missing_ms = (usage["input_tokens"] + 900 - left) / (1000 / 60) * 1000  # at 1000/60 tokens a second...
    assert (
        missing_ms - elapsed_ms - 1 <= int(headers["retry-after-ms"]) <= missing_ms + 1
    )  # ...less the refill
    assert int(headers["Retry-After"]) == -(-int(headers["retry-after-ms"]) // 1000)
    status, _, answer = gateway.request(
        "POST", "/v1/messages", message("z", model="sleepy", max_tokens=5000), key=LIMITED
    )
    assert status == 400 and "more than this key's 1000 tokens per minute" in answer["error"]["message"]


def test_a_repeated_idempotency_key_gets_the_first_answer_even_after_a_restart(tmp_path, state):
    key = f"idem-{uuid.uuid4()}"
    body = message("only once", model="sleepy")
    first = Gateway(tmp_path, config(state))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(
                lambda _: first.request("POST", "/v1/messages", body, {"Idempotency-Key": key}), range(4)
            ))
        status, _, mismatch = first.request(
            "POST", "/v1/messages", message("other"), {"Idempotency-Key": key}
        )
    finally:
        first.stop()
    second = Gateway(tmp_path, config(state))
    try:
        replay = second.request("POST", "/v1/messages", body, {"Idempotency-Key": key})
        calls = second.ready()["models"]["sleepy@1"]["calls"]
    finally:
        second.stop()
    assert {a[0] for a in answers} == {200} and len({a[2]["id"] for a in answers}) == 1
    assert replay[2] == answers[0][2] and calls == 0  # answered from the store, no worker call
    assert status == 400 and "different request body" in mismatch["error"]["message"]
    records = read_usage(str(state / "usage.sqlite"))
    assert [r.request_id for r in records].count(answers[0][2]["id"]) == 1
    assert len(records) == 1  # billed once, though asked five times across two gateways' lives


def test_usage_records_survive_a_restart_without_duplicates(tmp_path, state):
    ids, billed = [], {}
    for _ in range(2):
        server = Gateway(tmp_path, config(state))
        try:
            for text in ("one", "two", "three"):
                status, _, answer = server.request("POST", "/v1/messages", message(text))
                assert status == 200
                ids.append(answer["id"])
                billed[answer["id"]] = answer["usage"]["output_tokens"]
        finally:
            server.stop()
    records = read_usage(str(state / "usage.sqlite"))
    assert sorted(r.request_id for r in records) == sorted(ids) and len(set(ids)) == 6
    assert {(r.tenant, r.model, r.status, r.stop_reason) for r in records} == {
        ("tests", "echo@1", 200, "end_turn")
    }
    assert {r.request_id: r.output_tokens for r in records} == billed  # what each client was told
    assert all(r.key_id == hashlib.sha256(PAID.encode()).hexdigest()[:12] for r in records)


def test_every_answer_names_the_request_its_usage_record_is_filed_under(tmp_path, state):
    server = Gateway(tmp_path, config(state))
    try:
        answers = [
            server.request(
                "POST", "/v1/messages", message("x" * 90, model="sleepy", max_tokens=500), key=LIMITED
            ),
            server.request("POST", "/v1/messages", message("streamed", stream=True)),
            server.request(
                "POST", "/v1/messages", message("y" * 90, model="sleepy", max_tokens=900), key=LIMITED
            ),
        ]
        unknown = server.request("POST", "/v1/messages", message("x", model="nope"))
    finally:
        server.stop()
    assert [status for status, _, _ in answers] == [200, 200, 429]
    ids = [headers["request-id"] for _, headers, _ in answers]
    assert ids[0] == answers[0][2]["id"] and len(set(ids)) == 3
    statuses = {r.request_id: r.status for r in read_usage(str(state / "usage.sqlite"))}
    assert statuses == dict(zip(ids, [200, 200, 429], strict=False))
    assert unknown[1]["request-id"] not in statuses  # named, but refused before admission: nothing filed


def test_the_safety_stage_refuses_inputs_and_replaces_outputs(gateway):
    status, _, answer = gateway.request("POST", "/v1/messages", message("a FORBIDDEN question"))
    assert status == 400 and "refused by the safety policy" in answer["error"]["message"]
    status, _, answer = gateway.request("POST", "/v1/messages", message("dercas", model="sleepy"))
    assert status == 200 and answer["content"][0]["text"] == "I can't help with that."  # "sacred" reversed


def test_metrics_parse_and_show_every_family_with_no_key_or_prompt(gateway):
    for text in ("secret prompt text", "forbidden"):
        gateway.request("POST", "/v1/messages", message(text, model="sleepy"))
    gateway.request("POST", "/v1/messages", message("x", model="sleepy", max_tokens=5000), key=LIMITED)
    status, headers, body = gateway.request("GET", "/metrics", key=None)
    text = body["raw"].decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "ferry_requests", "ferry_ttft_seconds", "ferry_time_per_output_token_seconds",
        "ferry_request_latency_seconds", "ferry_queue_wait_seconds", "ferry_batch_size", "ferry_flushes",
        "ferry_worker_restarts", "ferry_batch_retries", "ferry_bisections", "ferry_admission_rejects",
        "ferry_queued_requests", "ferry_estimated_wait_seconds", "ferry_safety_blocks",
    } <= names
    assert 'ferry_requests_total{model="sleepy@1",status="200",tier="paid"} 1.0' in text
    assert 'ferry_safety_blocks_total{model="sleepy@1",stage="input"} 1.0' in text
    log = gateway.log.read_text()
    for secret in (PAID, LIMITED, "secret prompt text"):
        assert secret not in text and secret not in log


def test_two_gateways_sharing_a_key_in_redis_never_admit_more_than_its_limit(tmp_path, redis_url):
    limit = 6000
    # Sharing, not an outage: a slow answer on a loaded machine must not switch to local buckets.
    limits = f'[limits]\nstore = "redis"\nredis_url = "{redis_url}"\nredis_timeout_ms = 5000'
    gateways = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        gateways.append(Gateway(tmp_path / name, config(tmp_path / name, limits, tokens_per_minute=limit)))
    body = message("twenty bytes of text", max_tokens=10)  # output cut at max_tokens: no refund
    began = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda i: gateways[i % 2].request("POST", "/v1/messages", body, key=LIMITED), range(600)
            ))
    finally:
        elapsed = time.monotonic() - began
        for server in gateways:
            server.stop()
    admitted = [a for a in answers if a[0] == 200]
    cost = admitted[0][2]["usage"]["input_tokens"] + 10
    assert {a[0] for a in answers} == {200, 429}
    assert len(admitted) * cost <= limit + elapsed * limit / 60
    assert len(admitted) * cost >= limit - cost  # and the budget was really spent


def test_state_files_are_private_and_wider_ones_are_tightened_once(tmp_path, state):
    os.chmod(state, 0o755)
    for name in ("usage.sqlite", "idempotency.sqlite", "idempotency.sqlite-wal"):
        (state / name).touch()
        os.chmod(state / name, 0o644)
    server = Gateway(tmp_path, config(state))
    try:
        status, _, _ = server.request(
            "POST", "/v1/messages", message("kept"), {"Idempotency-Key": "private-1"}
        )
        files = ["usage.sqlite", "usage.sqlite-wal", "usage.sqlite-shm",
                 "idempotency.sqlite", "idempotency.sqlite-wal", "idempotency.sqlite-shm"]
        until(lambda: all((state / name).exists() for name in files),  # the usage writer commits within 50 ms
              "the usage and idempotency files, written", within=10)
        modes = {name: stat.S_IMODE((state / name).stat().st_mode) for name in files}
        directory = stat.S_IMODE(state.stat().st_mode)
    finally:
        server.stop()
    assert status == 200
    assert (directory, modes) == (0o700, dict.fromkeys(files, 0o600))
    tightened = [line for line in server.log.read_text().splitlines() if "tightened" in line]
    assert [line.split(" had ", 1)[0].rsplit(" ", 1)[1] for line in tightened] == [
        str(state), str(state / "usage.sqlite"), str(state / "idempotency.sqlite"),
        str(state / "idempotency.sqlite-wal"),
    ]


def test_a_new_state_directory_and_its_databases_are_created_private(tmp_path):
    from gateway.accounting.idempotency import IdempotencyStore
    from gateway.accounting.usage import UsageLog
    from gateway.config import StateConfig

    state = StateConfig(str(tmp_path / "fresh" / "state"))
    usage, idempotency = (
        UsageLog(state.path("usage.sqlite")),
        IdempotencyStore(state.path("idempotency.sqlite")),
    )
    try:
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "fresh" / "state").iterdir()}
    finally:
        usage.close()
        idempotency.close()
    assert stat.S_IMODE((tmp_path / "fresh" / "state").stat().st_mode) == 0o700
    assert {"usage.sqlite", "idempotency.sqlite"} <= set(modes) and set(modes.values()) == {
        0o600
    }  # and -wal, -shm
