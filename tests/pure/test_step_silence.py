"""The silence an engine is allowed during a step it announced as long, in virtual time.

The production pool over simulated 70B engines under ``MockClock(autojump_threshold=0)``: an
engine that announces a long step (a ``step`` frame) and then hangs in it is not killed at the
stats timeout but at its step's limit, ``STEP_SLACK`` times what it announced, never past
``max_step_ms`` whatever it announced, and never sooner than the stats timeout. One that falls
silent without an announcement is killed at the stats timeout, as before
(``test_engine_pool.py``: ``test_a_silent_engine_is_killed_at_the_stats_timeout...``).
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from batcher.continuous.silence import STEP_SLACK, SilenceLimit
from batcher.core.backend import Finished
from batcher.core.config import PoolConfig
from tests.support.engine_pool import Client, engines, job

BACKOFF = PoolConfig().restart_backoff
STATS_TIMEOUT, MAX_STEP = 0.5, 30.0
SETTINGS = {"stats_timeout_ms": STATS_TIMEOUT * 1000, "max_step_ms": MAX_STEP * 1000}
HUNG_AT = 0.3  # virtual time: answers under way


async def killed_after(spawn, stall_at: float, allowed: float) -> None:
    """Replica 0's engine is still the first one just before ``stall_at + allowed`` and
    restarted just after (killed then, restarted after the backoff)."""
    restart = stall_at + allowed + BACKOFF
    await trio.sleep_until(restart - 1e-6)
    assert len(spawn.spawned[0]) == 1
    await trio.sleep_until(restart + 1e-6)
    assert len(spawn.spawned[0]) == 2


@pytest.mark.parametrize(
    ("expected", "allowed"),
    [
        (2.0, STEP_SLACK * 2.0),  # a long step: the slack times its figure
        (math.inf, MAX_STEP),  # it could not tell: the bound
        (1e12, MAX_STEP),  # it claims forever: the bound
        (0.01, STATS_TIMEOUT),  # a short one: never less than the stats timeout
    ],
    ids=["long", "unmeasured", "huge", "short"],
)
async def test_an_engine_that_hangs_in_a_step_it_announced_is_killed_at_that_steps_limit(
    autojump_clock, expected, allowed
):
    async with engines(workers=2, **SETTINGS) as (pool, spawn):
        clients = [Client(), Client()]
        for i, client in enumerate(clients):
            pool.submit(job(40 + i, 300, stream=False), client)
        await trio.sleep(HUNG_AT)
        spawn.current(0).stall(expected)  # its step frame, then silence
        await killed_after(spawn, HUNG_AT, allowed)
        for client in clients:
            await client.done.wait()
        assert all(isinstance(c.events[-1], Finished) and len(c.text) == 300 for c in clients)
        assert pool.snapshot().counters.restarts == 1


async def test_an_engine_in_a_step_it_announced_outlives_the_stats_timeout_and_answers(autojump_clock):
    async with engines(workers=1, **SETTINGS) as (pool, spawn):
        client = Client()
        pool.submit(job(50, 300, stream=False), client)
        await trio.sleep(HUNG_AT)
        engine = spawn.current(0)
        engine.stall(1.0, seconds=3.0)  # a step of 3 s announced as 1 s: 6x the stats timeout
        await client.done.wait()
        assert isinstance(client.events[-1], Finished) and len(client.text) == 300
        assert pool.snapshot().counters.restarts == 0 and len(spawn.spawned[0]) == 1
        assert client.ended > HUNG_AT + 3.0
        # the stats after the step bring the stats timeout back
        pool.submit(job(51, 300, stream=False), Client())
        await trio.sleep(0.1)
        engine.freeze()
        await killed_after(spawn, engine.reported_at, STATS_TIMEOUT)


def test_a_step_is_allowed_the_slack_times_its_figure_between_the_stats_timeout_and_the_bound():
    limit = SilenceLimit(stats_timeout=5.0, max_step=60.0)
    assert [limit.of_step(s) for s in (0.0, 1.0, 2.0, 10.0, 15.0, 1e300, math.inf)] == [
        5.0, 5.0, 8.0, 40.0, 60.0, 60.0, 60.0
    ]
    assert SilenceLimit(stats_timeout=120.0, max_step=60.0).of_step(math.inf) == 120.0  # never shorter
