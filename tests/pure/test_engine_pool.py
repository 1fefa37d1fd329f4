"""The engine pool in virtual time: the production pool, replicas, router and admission over
simulated engines (the real engine scheduler and block manager, each step priced as a 70B model
on 8 x H100 would take), under ``MockClock(autojump_threshold=0)``, so every time is exact.

Queues on the gateway side and deadlines, cancellation in every state, the KV limit, admission
in tokens, engines that die or fall silent under streams and whole answers, and many steps in
one read. Real engine processes under the same pool: ``tests/system/test_engine_pool_processes.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from batcher.continuous.ticket import Stage
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling, Started
from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import Expired, RequestFailed, Shed, TooLarge
from tests.support.engine_pool import Client, engines, job
from tests.support.replica_loss import check_replica_0_lost, place_streams_and_wholes
from tests.support.waiting import until_trio
from workers.engine.cost_model import PRESETS
from workers.engine.loop import STATS_INTERVAL

COST = PRESETS["llama-70b"]
BACKOFF = PoolConfig().restart_backoff
EXACT = 1e-9  # MockClock jumps by differences of floats: the same instant, give or take an ulp


def alone(start: float, prompt: int, tokens: int) -> list[float]:
    """When a sequence alone on its engine gets each token: one prefill step, then decodes."""
    t = start + COST.step([prompt], [prompt]).seconds
    times = [t]
    for n in range(1, tokens):
        t += COST.step([1], [prompt + n]).seconds
        times.append(t)
    return times


async def test_a_lone_stream_gets_each_token_when_its_engine_step_ends(autojump_clock):
    async with engines(workers=1) as (pool, _spawn):
        client = Client()
        pool.submit(job(1, 20, stream=True), client)
        await client.done.wait()
    expected = alone(0.0, 10, 20)
    assert [type(e) for e in client.events] == [Started] + [Delta] * 20 + [Finished]
    assert client.times[1:-1] == pytest.approx(expected, abs=EXACT)
    assert client.ended == pytest.approx(expected[-1], abs=EXACT)
    assert client.ended == pytest.approx(0.1045, abs=1e-4)  # 20 steps of ~5.2 ms


async def test_a_job_whose_deadline_passes_in_the_queue_gets_529_at_its_deadline_and_never_reaches_an_engine(
    autojump_clock,
):
    async with engines(workers=1, max_seqs=1) as (pool, spawn):
        first, late = Client(), Client()
        running = pool.submit(job(1, 400, stream=True), first)
        await trio.sleep(0.1)  # virtual time: the late job arrives at t=0.1
        pool.submit(job(2, 5, stream=False, deadline=0.05), late)  # max_seqs 1: it waits in the pool
        await late.done.wait()
        [failed] = late.events
        assert late.ended == pytest.approx(0.15, abs=EXACT)
        assert isinstance(failed.error, Expired) and failed.retryable and failed.tokens_sent == 0
        assert str(failed.error).startswith("not started within 0.050s of arrival")
        pool.cancel(running)
        stats = spawn.current(0).engine.stats()
        assert stats.prefix_queries == 10  # the first job's prompt alone: the late one never arrived
        assert pool.snapshot().counters.expired == 1


async def test_a_job_cancelled_in_each_state_gets_no_further_event_and_leaves_nothing_behind(autojump_clock):
    async with engines(workers=2, max_seqs=1) as (pool, spawn):
        clients = {state: Client() for state in ("decoding", "queued", "rerun", "prefilling")}
        decoding = pool.submit(job(1, 500, stream=True, length=40), clients["decoding"])
        lost = pool.submit(job(2, 500, stream=False, length=40), clients["rerun"])
        assert (decoding.replica, lost.replica) == (0, 1)
        await until_trio(lambda: clients["decoding"].delivered, "the stream's first token", every=0.001)
        queued = pool.submit(job(3, 50, stream=True), clients["queued"])
        assert queued.state is Stage.QUEUED  # max_seqs 1: it waits in the pool
        pool.cancel(queued)
        killed_at = trio.current_time()
        spawn.current(1).kill()  # the whole answer showed nothing: a re-run, waiting for replica 0
        await trio.testing.wait_all_tasks_blocked()
        assert (lost.replica, lost.rerun_due) == (0, killed_at + 10.0)
        pool.cancel(lost)
        pool.cancel(decoding)
        prefilling = pool.submit(job(5, 50, stream=True, length=60), clients["prefilling"])
        await until_trio(lambda: prefilling.rid != -1, "the job sent to its engine", every=0.001)
        assert prefilling.state is Stage.PREFILLING  # sent to its engine, no token back yet
        pool.cancel(prefilling)
        await trio.sleep(2 * STATS_INTERVAL)  # virtual time: two stats reports later
        for slot in (0, 1):
            stats = spawn.current(slot).engine.stats()
            assert (stats.running, stats.waiting, stats.used_blocks, stats.free_blocks) == (0, 0, 0, 64)
        assert spawn.current(0).engine.stats().prefix_queries == 40 + 60  # neither queued job was sent
        assert [w.details["load_tokens"] for w in pool.snapshot().status.workers] == [0, 0]
        assert pool.snapshot().status.queued == 0
        assert pool.snapshot().counters.cancelled == 4
    assert not any(c.done.is_set() for c in clients.values())


async def test_a_request_that_could_never_fit_one_replicas_cache_is_refused_naming_the_limit(autojump_clock):
    async with engines(workers=2) as (pool, _spawn):
        client = Client()
        pool.submit(job(3, 100, stream=False, length=1000), client)
        [failed] = client.events
        assert isinstance(failed.error, TooLarge) and not failed.retryable
        assert str(failed.error) == (
            "prompt is too long for this model's KV cache: 1000 prompt tokens + max_tokens 100 need 69 "
            "blocks of 16 tokens; one replica holds 64 (1024 tokens)"
        )


async def test_a_killed_engine_ends_its_streams_that_sent_text_and_reruns_the_rest_unseen_elsewhere(
    autojump_clock,
):
    async with engines(workers=2) as (pool, spawn):
        streams, wholes = place_streams_and_wholes(pool)
        await trio.sleep(0.05)  # virtual time: t=0.05, the streams are under way
        killed_at = trio.current_time()
        spawn.current(0).kill()
        await check_replica_0_lost(pool, streams, wholes)
        assert all(lost.ended == killed_at for lost in streams[0::2])  # told at once
        assert len(spawn.spawned[0]) == 2 and len(spawn.spawned[1]) == 1


async def test_a_silent_engine_is_killed_at_the_stats_timeout_and_its_whole_answers_complete_elsewhere(
    autojump_clock,
):
    async with engines(workers=2, stats_timeout_ms=500) as (pool, spawn):
        clients = [Client(), Client()]
        for i, client in enumerate(clients):
            pool.submit(job(20 + i, 300, stream=False), client)
        await trio.sleep(0.3)  # virtual time: t=0.3, both answers under way
        frozen = spawn.current(0)
        last_report = frozen.reported_at
        frozen.freeze()  # alive, but silent
        restart = last_report + 0.5 + BACKOFF  # killed at the timeout, restarted after the backoff
        await trio.sleep_until(restart - 1e-6)
        assert len(spawn.spawned[0]) == 1
        await trio.sleep_until(restart + 1e-6)
        assert len(spawn.spawned[0]) == 2
        for client in clients:
            await client.done.wait()
        assert all(isinstance(c.events[-1], Finished) and len(c.text) == 300 for c in clients)
        assert pool.snapshot().counters.restarts == 1


async def test_with_every_engine_down_a_lost_answer_waits_for_the_restart_and_completes(autojump_clock):
    async with engines(workers=1) as (pool, spawn):
        client = Client()
        pool.submit(job(30, 200, stream=False), client)
        await trio.sleep(0.1)  # virtual time: t=0.1, the answer under way
        killed_at = trio.current_time()
        spawn.current(0).kill()
        await client.done.wait()
        assert isinstance(client.events[-1], Finished) and len(client.text) == 200
        assert client.ended == pytest.approx(alone(killed_at + BACKOFF, 10, 200)[-1], abs=EXACT)
        assert pool.snapshot().counters.reruns == 1 and pool.ready


async def test_a_lost_answer_that_no_engine_takes_within_its_budget_fails(autojump_clock):
    async with engines(workers=1, queue=QueueConfig(wait_budgets=(0.05, 0.05))) as (pool, spawn):
        client = Client()
        pool.submit(job(31, 200, stream=False), client)
        await trio.sleep(0.01)  # virtual time: t=0.01, the answer under way
        spawn.current(0).kill()
        await client.done.wait()
        [failed] = client.events  # nothing of the first run was shown
        assert isinstance(failed, Failed) and not failed.retryable
        assert str(failed.error) == "its engine was lost and no other took the request in time"
        assert client.ended == pytest.approx(0.06, abs=EXACT)  # BACKOFF (0.1) is longer than the budget


async def test_an_answer_whose_engines_die_under_it_max_attempts_times_fails(autojump_clock):
    async with engines(workers=2, max_attempts=2) as (pool, spawn):
        client = Client()
        ticket = pool.submit(job(32, 200, stream=False), client)
        for _ in range(2):
            await trio.sleep(0.01)  # virtual time: 10 ms into each run
            spawn.current(ticket.replica).kill()
        await client.done.wait()
        failed = client.events[-1]
        assert isinstance(failed.error, RequestFailed) and str(failed.error) == "its engine was lost 2 times"


async def test_steps_read_together_lose_no_token_and_show_no_stop_token(autojump_clock):
    # The gateway is too busy to read while the engine runs on, so one read brings many steps'
    # frames, some sequences' last step among them: every token is text in its answer, the
    # end-of-sequence id alone is not (it is delivered, and billed, with no text), whether
    # streamed or whole.
    async with engines(workers=1, eos_prob=0.02) as (pool, spawn):
        streams, wholes = [Client() for _ in range(8)], [Client() for _ in range(8)]
        for seed, (streamed, whole) in enumerate(zip(streams, wholes, strict=False)):
            pool.submit(job(seed, 45, stream=True), streamed)
            pool.submit(job(seed, 45, stream=False), whole)
        await until_trio(lambda: all(c.delivered for c in streams), "a token on every stream", every=0.001)
        spawn.current(0).hold_output(0.5)  # about 60 steps pile up unread
        for client in streams + wholes:
            await client.done.wait()
    ends = [client.events[-1] for client in streams + wholes]
    assert all(isinstance(end, Finished) for end in ends)
    assert {end.stop_reason for end in ends} == {"end_turn", "max_tokens"}  # some drew the end id
    for client, end in zip(streams + wholes, ends, strict=False):
        assert client.delivered == end.usage.output_tokens
        text_tokens = end.usage.output_tokens - (end.stop_reason == "end_turn")  # the end id is not text
        assert len(client.text) == text_tokens
    assert [c.text for c in streams] == [c.text for c in wholes]
    biggest = max(max(c.times.count(t) for t in set(c.times)) for c in streams)
    assert biggest > 20  # one read handed a stream many steps' tokens at one instant


async def test_with_paid_work_backlogged_a_free_job_is_shed_at_once_with_a_retry_after(autojump_clock):
    async with engines(workers=1, max_seqs=1, queue=QueueConfig(wait_budgets=(30.0, 0.05))) as (pool, _spawn):
        paid = [Client() for _ in range(3)]
        # max_seqs 1: one runs, two wait
        tickets = [pool.submit(job(40 + i, 300, stream=True), c) for i, c in enumerate(paid)]
        await trio.sleep(2 * STATS_INTERVAL + 0.01)  # virtual time: two backlogged reports: the rate is known
        assert pool.load().measured
        free = Client()
        pool.submit(Job("f", tuple(b"free question"), Sampling(50), "free", "acme", stream=True), free)
        [shed] = free.events
        assert isinstance(shed.error, Shed) and shed.retryable and shed.error.retry_after > 0.05
        assert "budget of 0.0" in str(shed.error) and pool.snapshot().counters.shed[1] == 1
        assert not any(c.done.is_set() for c in paid)  # paid is untouched
        for ticket in tickets:
            pool.cancel(ticket)


async def test_a_light_tenants_job_starts_before_a_heavy_tenants_queued_ones_that_came_first(autojump_clock):
    async with engines(workers=1, max_seqs=1) as (pool, _spawn):
        clients = [Client() for _ in range(5)]
        pool.submit(dataclasses.replace(job(1, 40, stream=True), tenant="heavy"), clients[0])  # the one seat
        for n in (1, 2, 3):
            pool.submit(dataclasses.replace(job(n + 1, 5, stream=True), tenant="heavy"), clients[n])
        await trio.sleep(0.01)
        pool.submit(dataclasses.replace(job(5, 5, stream=True), tenant="light"), clients[4])  # queued last
        for client in clients:
            await client.done.wait()
    started = sorted(range(5), key=lambda n: clients[n].times[0])
    assert started == [0, 4, 1, 2, 3]  # heavy was given 50 tokens already: light's turn comes first
