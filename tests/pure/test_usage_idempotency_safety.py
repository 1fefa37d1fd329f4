"""Usage records, idempotency keys and the safety blocklist, each on its own (gateway side)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from gateway.accounting.idempotency import IdempotencyStore, KeyReused
from gateway.accounting.usage import UsageLog, UsageRecord, read_usage
from gateway.text.safety import Blocklist


def record(request_id: str, output_tokens: int = 5) -> UsageRecord:
    return UsageRecord(
        request_id, 1.0, "acme", "k-1f2e", "ferry-fixed@1", 12, output_tokens, 0.2, 0.3, 200, "end_turn"
    )


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
            await asyncio.sleep(0.01)  # the request's simulated work: the repeats arrive while it runs
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
            await asyncio.sleep(10)  # the request's simulated work, abandoned long before it ends
            return 200, b"never"

        async def fast():
            return 200, b"second run"

        first = asyncio.create_task(store.run("key", "k", b"body", slow))
        await started.wait()
        waiter = asyncio.create_task(store.run("key", "k", b"body", fast))
        await asyncio.sleep(0)  # one turn of the loop, no clock: the waiter runs up to its wait for the first
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


def answer_with(text: bytes):
    async def compute():
        return 200, text
    return compute


def test_answers_expire_after_the_ttl_in_memory_and_on_disk(tmp_path):
    now = [1_000.0]
    path = str(tmp_path / "idem.sqlite")

    async def scenario():
        store = IdempotencyStore(path, ttl=3600, clock=lambda: now[0])
        first = await store.run("key", "k", b"body", answer_with(b"first"))
        now[0] += 3599
        kept = await store.run("key", "k", b"body", answer_with(b"second"))
        store.close()
        restarted = IdempotencyStore(path, ttl=3600, clock=lambda: now[0])
        from_disk = await restarted.run("key", "k", b"body", answer_with(b"third"))
        now[0] += 2  # 3601 s after the first answer
        expired_on_disk = await IdempotencyStore(path, ttl=3600, clock=lambda: now[0]).run(
            "key", "k", b"body", answer_with(b"fourth"))
        expired_in_memory = await restarted.run("key", "k", b"body", answer_with(b"fifth"))
        restarted.close()
        return first, kept, from_disk, expired_on_disk, expired_in_memory

    assert asyncio.run(scenario()) == (
        (200, b"first"), (200, b"first"), (200, b"first"), (200, b"fourth"), (200, b"fifth"))


def test_the_store_keeps_at_most_max_entries_rows_the_newest(tmp_path):
    now = [1_000.0]
    path = str(tmp_path / "idem.sqlite")

    async def scenario():
        store = IdempotencyStore(path, max_entries=3, clock=lambda: now[0])
        for index in range(5):
            now[0] += 1
            await store.run("key", f"k{index}", b"body", answer_with(b"%d" % index))
        now[0] += 60  # the next answer is due a sweep
        await store.run("key", "k5", b"body", answer_with(b"5"))
        store.close()

    asyncio.run(scenario())
    connection = sqlite3.connect(path)
    rows = connection.execute("SELECT idem_key FROM idempotency ORDER BY stored_at").fetchall()
    connection.close()
    assert rows == [("k3",), ("k4",), ("k5",)]


def test_answers_and_replays_do_not_wait_for_a_locked_database(tmp_path):
    """Writes are queued for the writer thread and lookups go to the reader thread: a database
    another process holds locked (a slow disk, a backup) holds up no answer on the event loop,
    where the store used to wait 5 s for the lock and then fail the request."""
    path = str(tmp_path / "idem.sqlite")

    async def scenario(store: IdempotencyStore):
        answers = [await store.run("key", f"k{i}", b"body", answer_with(b"%d" % i)) for i in range(20)]
        replay = store.run("key", "k7", b"body", answer_with(b"again"))
        with pytest.raises(StopIteration) as done:  # a recent answer: no await at all
            replay.send(None)
        return answers, done.value.value

    store = IdempotencyStore(path)
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        answers, replay = asyncio.run(asyncio.wait_for(scenario(store), 4))
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    store.close()  # the writer gets the lock now and commits all twenty
    assert answers == [(200, b"%d" % i) for i in range(20)] and replay == (200, b"7")
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT count(*) FROM idempotency").fetchone() == (20,)
    connection.close()
