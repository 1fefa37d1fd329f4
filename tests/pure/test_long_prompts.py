"""The long-prompt pool (``long_prompt_tokens``, ``long_workers``): its keys checked, the lane each
prompt takes, and the production pool over simulated engines in virtual time, one ordinary and
one long replica (each engine sized by its own table): long prompts land on the long replica,
ordinary ones never while the ordinary replica is up, each lane's admission estimate counts its
own queue, a resumed long stream stays in the long pool, and the scaler sees only the ordinary
slots. Over real HTTP with SmolLM2: ``tests/system/test_long_prompt_pool.py``."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.elastic import ContinuousFleet
from batcher.continuous.long_prompts import Lanes, lanes_of, split_spawn
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Failed, Finished, Sampling
from batcher.core.config import QueueConfig
from batcher.core.errors import Shed, TooLarge
from batcher.core.staffing import Staffing
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import QUEUE, Client, job
from tests.support.waiting import until_trio

LONG = 200  # prompts longer than this many tokens are long


def table(**settings) -> ContinuousModelConfig:
    """``sim@1``: simulated 70B engines, one ordinary and one long replica unless ``settings`` say
    otherwise; the long one with four times the KV cache and step budget."""
    return ContinuousModelConfig(name="sim@1", simulated="llama-70b", **{
        "workers": 1, "num_blocks": 64, "max_batch_tokens": 64, "max_seqs": 16, "long_prompt_tokens": LONG,
        "long_workers": 1, "long_num_blocks": 256, "long_max_batch_tokens": 256, **settings})


@contextlib.asynccontextmanager
async def lanes(queue: QueueConfig = QUEUE, **settings):
    """The production pool of :func:`table` over simulated engines, each lane's engines built
    from its own table; yields the pool and the spawns of the ordinary and the long engines."""
    config = table(**settings)
    ordinary = SimulatedEngines(EngineSpec.of(config))
    long = SimulatedEngines(EngineSpec.of(config.long_table()))
    async with open_engine_pool(config, queue, split_spawn(lanes_of(config), ordinary, long),
                                ByteTokenizer()) as pool:
        yield pool, ordinary, long


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"long_workers": 0}, "long_workers: expected long_prompt_tokens > 0 and long_workers >= 1 together"),
        ({"long_prompt_tokens": 0}, "long_prompt_tokens: expected long_prompt_tokens > 0 and long_workers"),
        ({"long_prompt_tokens": -1}, r"long_prompt_tokens: expected tokens in 0..context_window \(8192\)"),
        ({"long_prompt_tokens": 8192}, r"long_prompt_tokens: expected tokens in 0..context_window"),
        ({"long_workers": -1}, r"long_workers: expected 0..4096, got -1"),
        ({"long_max_batch_tokens": 8}, r"long_max_batch_tokens: expected max_seqs \(16\)..1048576"),
        ({"long_num_blocks": -1}, "long_num_blocks: expected >= 0"),
        ({"long_kv_memory_gb": 1.0}, "long_kv_memory_gb: expected long_num_blocks or long_kv_memory_gb"),
        ({"long_prompt_tokens": 0, "long_workers": 0}, "long_num_blocks: expected 0 unless long_workers"),
    ],
)
def test_a_long_pool_needs_a_threshold_and_replicas_and_sizes_of_its_own_within_the_replicas_rules(
    settings, error
):
    with pytest.raises(ValueError, match=error):
        table(**settings)


def test_the_long_replicas_run_their_own_table_and_the_others_sizes_where_they_name_none():
    long = table().long_table()
    assert (long.workers, long.num_blocks, long.max_batch_tokens, long.long_workers) == (1, 256, 256, 0)
    plain = table(long_num_blocks=0, long_max_batch_tokens=0, long_workers=2).long_table()
    assert (plain.workers, plain.num_blocks, plain.max_batch_tokens) == (2, 64, 64)
    assert "--max-batch-tokens 256" in " ".join(long.engine_argv())


def test_the_long_slots_follow_the_scalers_slots():
    assert lanes_of(table(min_workers=1, max_workers=3)) == Lanes(3, 1, LONG, (64, 256))
    assert lanes_of(ContinuousModelConfig(name="sim@1", simulated="llama-70b", workers=2)) == Lanes(
        2, 0, 0, (512, 512))


def test_a_prompt_takes_its_lane_and_an_ordinary_one_the_long_lane_only_while_no_ordinary_engine_is_up():
    lanes = Lanes(2, 1, LONG, (64, 256))
    staffing = Staffing(2, 2, fixed=1)
    assert (lanes.long_prompt(LONG), lanes.long_prompt(LONG + 1)) == (False, True)
    assert lanes.candidates(False, staffing, [True, True, True]) == {0, 1}
    assert lanes.candidates(True, staffing, [True, True, True]) == {2}
    assert lanes.candidates(False, staffing, [False, True, True]) == {0, 1}  # one ordinary is up
    assert lanes.candidates(False, staffing, [False, False, True]) == {2}  # none: the long one takes it
    assert lanes.candidates(True, staffing, [True, True, False]) == {2}  # never on an ordinary one
    assert lanes.candidates(False, staffing, [False, False, False]) == {0, 1}  # it waits for its own
    scaled_to_zero = Staffing(2, 0, fixed=1)
    assert lanes.candidates(False, scaled_to_zero, [False, False, True]) == {0}  # the scaler starts it


async def test_long_prompts_land_on_the_long_replica_and_ordinary_ones_never_while_an_ordinary_one_is_up(
    autojump_clock,
):
    async with lanes() as (pool, ordinary, long):
        clients = [Client() for _ in range(12)]
        tickets = [pool.submit(job(i, 20, stream=True, length=LONG + 400 if i % 4 == 0 else 30), c)
                   for i, c in enumerate(clients)]
        for client in clients:
            await client.done.wait()
        assert all(isinstance(c.events[-1], Finished) and c.delivered == 20 for c in clients)
        assert [t.replica for t in tickets] == [1 if i % 4 == 0 else 0 for i in range(12)]
        own, others = long.current(1).engine.config, ordinary.current(0).engine.config
        assert (own.max_batch_tokens, own.num_blocks) == (256, 256)  # its own step budget and cache
        assert (others.max_batch_tokens, others.num_blocks) == (64, 64)
        workers = pool.snapshot().status.workers
        assert [w.details.get("long_pool", 0) for w in workers] == [0, 1]


async def test_an_ordinary_prompt_goes_to_the_long_replica_only_while_no_ordinary_engine_is_up(
    autojump_clock,
):
    async with lanes() as (pool, ordinary, _long):
        ordinary.current(0).kill()
        await until_trio(lambda: not pool.replicas[0].up, "the ordinary engine down", every=0.001)
        client = Client()
        assert pool.submit(job(1, 20, stream=True, length=30), client).replica == 1
        await client.done.wait()
        await until_trio(lambda: pool.replicas[0].up, "the ordinary engine back", every=0.001)
        assert pool.submit(job(2, 20, stream=True, length=30), Client()).replica == 0


async def test_each_lanes_estimate_counts_its_own_queue_so_a_long_flood_is_shed_and_ordinary_requests_are_not(
    autojump_clock,
):
    queue = QueueConfig(tiers=("paid",), wait_budgets=(0.5,))
    async with lanes(queue) as (pool, _ordinary, _long):
        flood = [Client() for _ in range(40)]
        for i, client in enumerate(flood):
            pool.submit(job(i, 64, stream=True, length=1000), client)
        assert pool.load(long=True).queued[0] > 0 and pool.load(long=False).queued[0] == 0
        await until_trio(lambda: pool.load(long=True).measured, "the long engine's rate", every=0.001)
        later = [Client() for _ in range(40)]
        for i, client in enumerate(later):
            pool.submit(job(100 + i, 64, stream=True, length=1000), client)
        chats = [Client() for _ in range(8)]
        for i, client in enumerate(chats):
            pool.submit(job(200 + i, 20, stream=True, length=30), client)
        for client in flood + later + chats:
            await client.done.wait()
    shed = [c for c in later if isinstance(c.events[-1], Failed) and isinstance(c.events[-1].error, Shed)]
    assert shed, "the long pool's backlog sheds long prompts past their budget"
    assert all(isinstance(c.events[-1], Finished) for c in chats)  # the ordinary pool's queue is empty
    assert all(isinstance(c.events[-1], Finished) for c in flood)


async def test_a_resumed_long_stream_goes_on_in_the_long_pool(autojump_clock):
    async with lanes(on_engine_loss="resume", long_workers=2) as (pool, _ordinary, long):
        client, seeded = Client(), job(5, 300, stream=True, length=LONG + 100)
        ticket = pool.submit(dataclasses.replace(seeded, sampling=Sampling(300, seed=5)), client)
        assert ticket.replica == 1
        await until_trio(lambda: client.delivered > 20, "text on the stream", every=0.001)
        long.current(1).kill()
        await until_trio(lambda: ticket.replica != 1, "the stream placed again", every=0.001)
        assert ticket.replica == 2
        await client.done.wait()
    assert isinstance(client.events[-1], Finished) and client.delivered == 300
    assert pool.snapshot().counters.resumed == 1


async def test_the_scaler_sees_and_retires_only_the_ordinary_replicas(autojump_clock):
    async with lanes(workers=2) as (pool, _ordinary, _long):
        fleet = ContinuousFleet(pool)
        floods = [Client() for _ in range(6)]
        for i, client in enumerate(floods):
            pool.submit(job(i, 200, stream=True, length=1000), client)
        await until_trio(lambda: pool.replicas[2].live, "the long replica busy", every=0.001)
        signals = fleet.signals()
        assert (signals.queued, signals.busy, signals.wait) == (0, 0, 0.0)  # the long backlog is not its
        assert pool.fleet().serving == 2
        pool.retire(3)
        assert pool.staffing.leaving == {0, 1}
        assert pool.submit(job(9, 10, stream=True, length=LONG + 1), Client()).replica == 2


async def test_a_prompt_too_large_is_judged_by_its_own_lanes_kv_cache(autojump_clock):
    async with lanes() as (pool, _ordinary, _long):
        document, chat = Client(), Client()
        pool.submit(job(1, 100, stream=False, length=1500), document)  # 100 of the long replica's 256 blocks
        pool.submit(job(2, 1000, stream=False, length=LONG), chat)  # 75 blocks: the ordinary ones hold 64
        await document.done.wait()
        await chat.done.wait()
    assert isinstance(document.events[-1], Finished) and document.delivered == 100
    failed = chat.events[-1]
    assert isinstance(failed, Failed) and isinstance(failed.error, TooLarge)
    assert "one replica holds 64" in str(failed.error)


async def test_a_long_prompt_waits_for_the_long_replica_to_restart_rather_than_stall_the_ordinary_one(
    autojump_clock,
):
    async with lanes() as (pool, _ordinary, long):
        long.current(1).kill()
        await until_trio(lambda: not pool.replicas[1].up, "the long engine down", every=0.001)
        document, chat = Client(), Client()
        assert pool.submit(job(1, 20, stream=True, length=LONG + 400), document).replica == 1
        assert pool.submit(job(2, 20, stream=True, length=30), chat).replica == 0
        await chat.done.wait()
        await document.done.wait()
    assert isinstance(document.events[-1], Finished) and chat.ended < document.ended
