"""What ``/readyz`` says of a continuous pool's replicas, in virtual time: how old each engine's
last ``stats`` report is, so that a reader knows how old the engine figures beside it (and the
counters in ``/metrics``) are."""

from __future__ import annotations

import trio

from tests.support.engine_pool import engines


def report_ages(pool) -> list[int]:
    return [worker.details["stats_age_ms"] for worker in pool.snapshot().status.workers]


async def test_each_replica_says_how_old_its_engines_last_report_is_and_a_silent_one_ages(autojump_clock):
    async with engines(workers=2) as (pool, spawn):  # each engine reports at 0, 0.2, 0.4 s...
        await trio.sleep_until(0.35)
        assert report_ages(pool) == [150, 150]
        spawn.current(1).freeze()  # alive, but silent
        await trio.sleep_until(0.55)
        assert report_ages(pool) == [150, 350]
