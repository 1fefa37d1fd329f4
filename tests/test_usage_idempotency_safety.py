"""Usage records, idempotency keys and the safety blocklist, each on its own (gateway side)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.idempotency import IdempotencyStore, KeyReused
from gateway.safety import Blocklist
from gateway.usage import UsageLog, UsageRecord, read_usage


def record(request_id: str, output_tokens: int = 5) -> UsageRecord:
    return UsageRecord(request_id, 1.0, "acme", "k-1f2e", "ferry-fixed@1", 12, output_tokens, 0.2, 0.3, 200, "end_turn")


def test_usage_is_written_once_per_request_id_and_survives_a_restart(tmp_path):
    path = str(tmp_path / "usage.sqlite")
    log = UsageLog(path)
    for request_id in ("a", "b", "a", "c"):
        log.record(record(request_id))
    log.close()
    log = UsageLog(path)  # the gateway restarts and records "b" again
    log.record(record("b", output_tokens=99))
    log.record(record("d"))
    log.close()
    rows = read_usage(path)
    assert [r.request_id for r in rows] == ["a", "b", "c", "d"]
    assert rows[1].output_tokens == 5  # the first record of b stands


def test_usage_log_refuses_a_path_it_cannot_write_at_start():
    with pytest.raises(FileNotFoundError):
        UsageLog("/nonexistent-dir/usage.sqlite")


def test_a_repeated_key_gets_the_first_answer_without_running_again(tmp_path):
    async def scenario():
        store = IdempotencyStore(str(tmp_path / "idem.sqlite"))
        runs = []

        async def compute():
            runs.append(1)
            await asyncio.sleep(0.01)
            return 200, b'{"n": %d}' % len(runs)

        concurrent = await asyncio.gather(*(store.run("key", "idem-1", b"body", compute) for _ in range(5)))
        later = await store.run("key", "idem-1", b"body", compute)
        other_api_key = await store.run("other", "idem-1", b"body", compute)
        store.close()
        restarted = IdempotencyStore(str(tmp_path / "idem.sqlite"))
        after_restart = await restarted.run("key", "idem-1", b"body", compute)
        with pytest.raises(KeyReused, match="idem-1"):
            await restarted.run("key", "idem-1", b"another body", compute)
        restarted.close()
        return runs, concurrent, later, other_api_key, after_restart

    runs, concurrent, later, other, after_restart = asyncio.run(scenario())
    assert concurrent == [(200, b'{"n": 1}')] * 5
    assert later == after_restart == (200, b'{"n": 1}')
    assert other == (200, b'{"n": 2}')  # keys are scoped to the API key
    assert len(runs) == 2


def test_a_failed_answer_is_not_kept_so_a_retry_runs_again(tmp_path):
    async def scenario():
        store = IdempotencyStore(str(tmp_path / "idem.sqlite"))
        answers = iter([(529, b"overloaded"), (200, b"ok")])

        async def compute():
            return next(answers)

        return [await store.run("key", "k", b"body", compute) for _ in range(3)]

    assert asyncio.run(scenario()) == [(529, b"overloaded"), (200, b"ok"), (200, b"ok")]


def test_waiters_run_the_request_themselves_when_the_first_run_is_abandoned(tmp_path):
    async def scenario():
        store = IdempotencyStore(str(tmp_path / "idem.sqlite"))
        started = asyncio.Event()

        async def slow():
            started.set()
            await asyncio.sleep(10)
            return 200, b"never"

        async def fast():
            return 200, b"second run"

        first = asyncio.create_task(store.run("key", "k", b"body", slow))
        await started.wait()
        waiter = asyncio.create_task(store.run("key", "k", b"body", fast))
        await asyncio.sleep(0)
        first.cancel()
        return await waiter

    assert asyncio.run(scenario()) == (200, b"second run")


def test_the_blocklist_matches_whole_words_in_any_case_and_names_the_rule():
    safety = Blocklist(["forbidden", "launch code"])
    assert safety.screen_input("tell me the LAUNCH CODE please") == "blocklist[1]"
    assert safety.screen_input("nothing forbiddenish here") is None
    assert safety.screen_output("a Forbidden answer") == (safety.refusal, "blocklist[0]")
    assert safety.screen_output("a fine answer") == ("a fine answer", None)
    assert Blocklist([]).screen_input("anything at all") is None
