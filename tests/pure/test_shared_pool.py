"""Shared pools: the pure core's claims and eviction order, and two fixed-mode versions taking
turns on one slot through the production batcher, pool and scaler over simulated workers, in
virtual time (MockClock): a request to a version with no worker evicts the idle one and is
answered; a version busy in every slot is never stopped, and a request that would wait past
its budget for a slot gets 503 (Starting) with the time to ready, while a patient one is served
once the busy version has finished. A continuous version shares a pool with a fixed one the
same way; a bad ``[[pools]]`` or ``pool`` is a config error naming the field."""

from __future__ import annotations

import contextlib
import math

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.mode import open_continuous
from batcher.core.backend import Finished
from batcher.core.config import QueueConfig
from batcher.core.errors import Starting
from batcher.core.scaling import TICK
from batcher.core.shared_pool import Claim, SharedPool
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.mode import open_fixed
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.config import parse_config
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import Client, job
from tests.support.fixed_batcher import Outcomes
from tests.support.spawner import Spawner

BUDGETS = QueueConfig(wait_budgets=(1.0, 0.3))


def pool_of(slots: int, **held: tuple[int, float]) -> SharedPool:
    """A pool whose members hold (slots, idle since: inf for one with work)."""
    pool = SharedPool("rare", slots)
    for version, (count, idle_since) in held.items():
        pool.join(version)
        pool.seen(version, count, idle_since == math.inf, idle_since)
    return pool


def test_a_claim_takes_free_slots_first_and_evicts_nobody():
    pool = pool_of(3, a=(1, 5.0), b=(0, 0.0))
    assert pool.claim("b", 2) == Claim(2)
    assert pool.free == 0 and pool.members["b"].held == 2


def test_with_every_slot_held_the_member_idle_longest_is_evicted_and_only_once():
    pool = pool_of(2, a=(1, 10.0), b=(1, 3.0), c=(0, 0.0))
    assert pool.claim("c", 1) == Claim(0, ("b",))  # idle since 3.0: longer than a
    assert pool.claim("c", 1) == Claim(0)  # b is still draining: its slot is as good as claimed
    pool.seen("b", 0, False, 20.0)  # b's worker stopped
    assert pool.claim("c", 1) == Claim(1) and not pool.members["b"].evicting


def test_a_member_with_work_is_never_evicted():
    pool = pool_of(2, a=(1, math.inf), b=(1, math.inf), c=(0, 0.0))
    assert pool.claim("c", 1) == Claim(0)
    pool.seen("a", 1, False, 7.0)  # a's work is done
    assert pool.claim("c", 1) == Claim(0, ("a",))


@contextlib.asynccontextmanager
async def version(name: str, fleet: Spawner):
    model = FixedModelConfig(name=name, worker=["sleep"], pool="rare", pool_slots=1, max_batch=1,
                             max_wait_ms=0, idle_after_s=600.0, hang_timeout_ms=60000)
    async with open_fixed(model, BUDGETS, fleet, ByteTokenizer()) as batcher:
        yield batcher


async def test_a_request_to_a_version_without_a_slot_evicts_the_idle_one_and_is_answered(autojump_clock):
    a_fleet, b_fleet = Spawner(start_s=1.0), Spawner(start_s=1.0)
    async with version("a@1", a_fleet) as a, version("b@1", b_fleet) as b:
        first = await a.answer("one", "paid", timeout=30.0)
        held = a.pool.fleet().serving
        second = await b.answer("two", "paid", timeout=30.0)
        after = a.pool.fleet().serving, b.pool.fleet().serving
        evicted = a.snapshot().status.scaling
        events = dict(a.counters.scale_events)
    assert (first, held, second, after) == ("eno", 1, "owt", (0, 1))
    assert evicted == "down 1 -> 0 (evicted): pool 'rare''s slot goes to b@1, which has work"
    assert events[("down", "evicted")] == 1 and a_fleet.worker(0).stopped


async def test_a_busy_version_keeps_its_slot_a_short_budget_gets_503_and_a_patient_request_waits(
        autojump_clock):
    a_fleet, b_fleet = Spawner(start_s=1.0, service=10.0), Spawner(start_s=1.0)
    async with version("a@1", a_fleet) as a, version("b@1", b_fleet) as b:
        assert await b.answer("warm", "paid", timeout=30.0) == "mraw"  # b's start is measured: 1 s
        outcomes = Outcomes(a)
        long_call = outcomes.add(["long"], "paid", timeout=60.0)[0]
        await trio.sleep(3.0)  # b evicted, a started and in its 10 s call
        busy = a.pool.busy_count
        waiting = Outcomes(b)
        refused = waiting.add(["short"], "free")[0]  # 0.3 s: shorter than a start, with no slot
        patient = waiting.add(["patient"], "paid", timeout=60.0)[0]
        await trio.sleep(2 * TICK)
        held = b.pool.fleet().starting, b.snapshot().status.scaling
        await outcomes.wait(1)
        stopped_in_call = a_fleet.worker(0).stopped
        await waiting.wait(2)
    assert busy == 1 and held == (0, "waiting for a slot of pool 'rare': every slot is held")
    assert isinstance(refused.error, Starting) and refused.error.retry_after == 1.0
    assert long_call.result() == "gnol" and not stopped_in_call  # never stopped in its call
    assert patient.result() == "tneitap"


async def test_a_continuous_version_evicts_an_idle_fixed_one_from_their_pool_and_is_answered(autojump_clock):
    engines = ContinuousModelConfig(name="c@1", simulated="llama-70b", num_blocks=64, max_batch_tokens=64,
                                    max_seqs=16, pool="rare", pool_slots=1, idle_after_s=600.0)
    spawn = SimulatedEngines(EngineSpec.of(engines), start_s=2.0)
    async with version("a@1", Spawner(start_s=1.0)) as fixed, \
            open_continuous(engines, QueueConfig(wait_budgets=(10.0, 2.0)), spawn, ByteTokenizer()) as pool:
        assert await fixed.answer("one", "paid", timeout=30.0) == "eno"
        client = Client()
        pool.submit(job(1, 8, stream=False), client)
        await client.done.wait()
        after = fixed.pool.fleet().serving, pool.fleet().serving
    assert isinstance(client.events[-1], Finished) and after == (0, 1)


CONFIG = """
[[tiers]]
name = "paid"

[[pools]]
name = "rare"
slots = 2

[[models]]
name = "a@1"
worker = ["sleep"]
pool = "rare"
"""


@pytest.mark.parametrize(("change", "error"), [
    (('pool = "rare"', 'pool = "often"'), "models[0].pool: expected a [[pools]] name, one of ['rare']"),
    (('pool = "rare"', 'pool = "rare"\nmin_workers = 1'), "models[0].min_workers: expected 0 in shared pool"),
    (('pool = "rare"', 'pool = "rare"\nmax_workers = 3'), "models[0].max_workers: expected at most pool"),
    (("slots = 2", "slots = 0"), "pools[0].slots: expected 1..4096, got 0"),
])
def test_a_bad_pool_is_a_config_error_naming_the_field(change, error):
    assert parse_config(CONFIG).models[0].scaling(8).max_workers == 1  # the default in a pool
    with pytest.raises(ValueError) as raised:
        parse_config(CONFIG.replace(*change))
    assert error in str(raised.value)
