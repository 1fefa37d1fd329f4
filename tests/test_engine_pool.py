"""The engine pool over real engine worker processes (simulated engines: seeded ASCII tokens, each
step as long as a 70B model on 8 x H100 would take, 5 ms or more): queues on the gateway side,
cancellation, the KV limit, admission in tokens, engines that die or fall silent under streams and whole answers, and
one step's tokens crossing the bridge together.

The real clock runs these (subprocess I/O); bounds are generous and nothing asserts speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import trio

from batcher.backend import Delta, Failed, Finished, Job, Started
from batcher.config import ContinuousModelConfig, QueueConfig
from batcher.continuous import open_engine_pool
from batcher.engine_worker import EngineProcess
from batcher.process_worker import process_workers
from batcher.supervisor import WorkerStartError
from batcher.types import Expired, ReplicaLost, Shed, TooLarge
from gateway.tokenizer import ByteTokenizer
from tests.harness import KEY, ScriptedBackend, in_process, run, sse
from tests.test_worker_processes import wait_for

QUEUE = QueueConfig(wait_budgets=(10.0, 10.0))


class Client:
    """One job's caller: every event it was given, and whether it has its last."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = trio.Event()

    def __call__(self, event) -> None:
        assert not self.done.is_set(), f"{event} after the end"
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def delivered(self) -> int:
        return sum(e.tokens for e in self.events if isinstance(e, Delta))


@contextlib.asynccontextmanager
async def engines(workers: int = 2, eos_prob: float = 0.0, **settings):
    config = ContinuousModelConfig(name="sim@1", simulated="llama-70b", workers=workers,
                                   **{"num_blocks": 64, "max_batch_tokens": 64, "max_seqs": 16, **settings})
    spawn = process_workers([*config.engine_argv(), "--sim-eos-prob", str(eos_prob)], workers, kind=EngineProcess)
    async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()) as pool:
        yield pool


def job(seed: int, max_tokens: int, stream: bool, length: int = 10, **fields) -> Job:
    prompt = bytes((seed * 7 + i) % 90 + 32 for i in range(length))
    return Job(prompt.decode(), tuple(prompt), max_tokens, "paid", "acme", stream=stream, **fields)


def pids(pool) -> list[int]:
    return [worker.pid for worker in pool.snapshot().status.workers]


async def settled(pool, **expected) -> None:
    """Wait until every replica's report shows ``expected``, from a report made after now (an
    engine reports every 200 ms)."""
    def matches() -> bool:
        replicas = pool.snapshot().stats.replicas
        return all(all(getattr(r.engine, k) == v for k, v in expected.items()) for r in replicas)

    await trio.sleep(0.5)
    await wait_for(matches, seconds=10)


async def test_engines_that_cannot_start_fail_the_pool_start_with_one_error_naming_the_model():
    config = ContinuousModelConfig(name="sim@1", simulated="llama-70b", workers=2)
    spawn = process_workers([*config.engine_argv(), "--no-such-flag"], 2, kind=EngineProcess)
    reason = r"sim@1: 2 of 2 workers did not start; first: worker 0: WorkerLost\('pid \d+ exited with code"
    with pytest.RaisesGroup(pytest.RaisesExc(WorkerStartError, match=reason), flatten_subgroups=True):
        async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()):
            pass  # pragma: no cover - never reached


async def test_a_job_whose_deadline_passes_in_the_queue_gets_529_and_never_reaches_an_engine():
    async with engines(workers=1, max_seqs=1) as pool:
        first, late = Client(), Client()
        running = pool.submit(job(1, 400, stream=True), first)
        await wait_for(lambda: first.delivered > 0)
        pool.submit(job(2, 5, stream=False, deadline=0.05), late)  # max_seqs 1: it waits in the pool
        with trio.fail_after(5):
            await late.done.wait()
        [failed] = late.events
        assert isinstance(failed.error, Expired) and failed.retryable and failed.tokens_sent == 0
        pool.cancel(running)
        await settled(pool, running=0)
        [replica] = pool.snapshot().stats.replicas
        assert replica.engine.prefix_queries == 10  # the first job's prompt alone: the late one never arrived
        assert pool.snapshot().stats.expired == 1


async def test_cancelled_streams_are_aborted_and_their_blocks_free_by_the_next_report():
    async with engines(workers=1) as pool:
        clients = [Client() for _ in range(5)]
        tickets = [pool.submit(job(i, 900, stream=True, length=40), c) for i, c in enumerate(clients)]
        await wait_for(lambda: all(c.delivered for c in clients))
        for ticket in tickets:
            pool.cancel(ticket)
        await settled(pool, running=0, waiting=0, used_blocks=0, free_blocks=64)
        assert all(not c.done.is_set() for c in clients)  # a cancelled job gets no further event
        assert pool.snapshot().status.workers[0].details["load_tokens"] == 0


async def test_a_request_that_could_never_fit_one_replicas_cache_is_refused_naming_the_limit():
    async with engines(workers=2) as pool:
        client = Client()
        pool.submit(job(3, 100, stream=False, length=1000), client)
        [failed] = client.events
        assert isinstance(failed.error, TooLarge) and not failed.retryable
        assert str(failed.error) == (
            "prompt is too long for this model's KV cache: 1000 prompt tokens + max_tokens 100 need 69 "
            "blocks of 16 tokens; one replica holds 64 (1024 tokens)")


async def test_a_killed_engine_ends_its_streams_that_sent_text_and_reruns_the_rest_unseen_elsewhere():
    async with engines(workers=2) as pool:
        streams = [Client() for _ in range(4)]
        wholes = [Client() for _ in range(4)]
        placed = [pool.submit(job(i, 600, stream=True), c) for i, c in enumerate(streams)]
        placed += [pool.submit(job(10 + i, 120, stream=False), c) for i, c in enumerate(wholes)]
        assert [t.replica for t in placed] == [0, 1, 0, 1, 0, 1, 0, 1]  # least queued tokens
        await wait_for(lambda: all(c.delivered for c in streams))
        os.kill(pids(pool)[0], signal.SIGKILL)
        with trio.fail_after(30):
            for client in streams + wholes:
                await client.done.wait()
        for lost in streams[0::2]:  # replica 0's streams: an error saying what they had
            failed = lost.events[-1]
            assert isinstance(failed, Failed) and isinstance(failed.error, ReplicaLost) and failed.retryable
            assert failed.tokens_sent == lost.delivered == len(lost.text.encode()) > 0
        for kept in streams[1::2]:
            assert isinstance(kept.events[-1], Finished) and kept.delivered == 600
        for index, whole in enumerate(wholes):  # all complete, replica 0's on replica 1
            assert [type(e) for e in whole.events] == [Started, Delta, Finished]
            alone = Client()
            pool.submit(job(10 + index, 120, stream=False), alone)
            await alone.done.wait()
            assert whole.text == alone.text and len(whole.text) == 120
        stats = pool.snapshot().stats
        assert (stats.reruns, stats.interrupted, stats.restarts) == (2, 2, 1)


async def test_an_engine_that_sends_no_stats_is_killed_and_its_whole_answers_complete_elsewhere():
    async with engines(workers=2, stats_timeout_ms=500) as pool:
        clients = [Client(), Client()]
        for i, client in enumerate(clients):
            pool.submit(job(20 + i, 300, stream=False), client)
        await wait_for(lambda: all(r.engine.running for r in pool.snapshot().stats.replicas))
        stopped = pids(pool)[0]
        os.kill(stopped, signal.SIGSTOP)  # alive, but silent
        with trio.fail_after(30):
            for client in clients:
                await client.done.wait()
        assert all(isinstance(c.events[-1], Finished) and len(c.text) == 300 for c in clients)
        await wait_for(lambda: pids(pool)[0] not in (None, stopped))
        assert pool.snapshot().stats.restarts == 1


async def test_with_every_engine_down_a_lost_answer_waits_for_the_restart_and_completes():
    async with engines(workers=1) as pool:
        client = Client()
        pool.submit(job(30, 200, stream=False), client)
        await wait_for(lambda: pool.snapshot().stats.replicas[0].engine.running == 1)
        os.kill(pids(pool)[0], signal.SIGKILL)
        with trio.fail_after(30):
            await client.done.wait()
        assert isinstance(client.events[-1], Finished) and len(client.text) == 200
        assert pool.snapshot().stats.reruns == 1 and pool.ready


async def test_steps_read_together_lose_no_token_and_show_no_stop_token():
    # The gateway is busy (here: its trio thread blocked) while the engine runs on, so one read
    # brings many steps' frames, some sequences' last step among them: every token is text in its
    # answer, the end-of-sequence id alone is not, whether streamed or whole.
    async with engines(workers=1, eos_prob=0.02) as pool:
        streams, wholes = [Client() for _ in range(8)], [Client() for _ in range(8)]
        for seed, (streamed, whole) in enumerate(zip(streams, wholes)):
            pool.submit(job(seed, 45, stream=True), streamed)
            pool.submit(job(seed, 45, stream=False), whole)
        await wait_for(lambda: all(c.delivered for c in streams))
        time.sleep(0.5)  # about 100 steps of the simulated engine pile up in its pipe
        with trio.fail_after(30):
            for client in streams + wholes:
                await client.done.wait()
    ends = [client.events[-1] for client in streams + wholes]
    assert all(isinstance(end, Finished) for end in ends)
    assert {end.stop_reason for end in ends} == {"end_turn", "max_tokens"}  # some drew the end id
    for client, end in zip(streams + wholes, ends):
        shown = end.usage.output_tokens - (end.stop_reason == "end_turn")  # the end id is not text
        assert client.delivered == len(client.text) == shown
    assert [c.text for c in streams] == [c.text for c in wholes]


IN_PROCESS = """
[[tiers]]
name = "paid"
wait_budget_ms = 10000
[[keys]]
key = "sk-harness-paid-01"
tenant = "harness"
tier = "paid"
[[models]]
name = "sim@1"
mode = "continuous"
simulated = "llama-70b"
workers = 1
num_blocks = 64
max_batch_tokens = 64
max_seqs = 16
"""


def test_the_tokens_of_one_engine_step_cross_to_the_http_side_in_one_hop(tmp_path):
    async def body():
        others = {"sim@1": lambda: engines(workers=1)}
        async with in_process(ScriptedBackend(), IN_PROCESS, str(tmp_path), others) as (client, bridge):
            async def one(index: int) -> list:
                request = {"model": "sim@1", "max_tokens": 30, "stream": True,
                           "messages": [{"role": "user", "content": f"stream {index}"}]}
                response = await client.post("/v1/messages", json=request, headers={"x-api-key": KEY})
                return sse(await response.read())

            streams = await asyncio.gather(*(one(i) for i in range(16)))
            await asyncio.sleep(0.5)  # the engine's report of its last steps
            hops = bridge.hops_to_asyncio
            snapshot = (await bridge.snapshots())["sim@1"]
            return streams, hops, snapshot.stats.step_tokens.count

    streams, hops, steps = run(body)
    texts = ["".join(d["delta"]["text"] for name, d in events if name == "content_block_delta") for events in streams]
    assert all(len(text) == 30 for text in texts)
    assert 30 <= steps and hops <= steps + 16  # 480 tokens crossed in about a hop per step, not 480 hops


async def test_with_paid_work_backlogged_a_free_job_is_shed_at_once_with_a_retry_after():
    config = ContinuousModelConfig(name="sim@1", simulated="llama-70b", workers=1, num_blocks=64,
                                   max_batch_tokens=64, max_seqs=1)
    spawn = process_workers(config.engine_argv(), 1, kind=EngineProcess)
    budgets = QueueConfig(wait_budgets=(30.0, 0.05))
    async with open_engine_pool(config, budgets, spawn, ByteTokenizer()) as pool:
        paid = [Client() for _ in range(3)]
        tickets = [pool.submit(job(40 + i, 300, stream=True), c) for i, c in enumerate(paid)]  # one runs, two wait
        await wait_for(lambda: pool.load().measured)  # a backlogged report or two: the rate is known
        free = Client()
        pool.submit(Job("f", tuple(b"free question"), 50, "free", "acme", stream=True), free)
        [shed] = free.events
        assert isinstance(shed.error, Shed) and shed.retryable and shed.error.retry_after > 0.05
        assert "budget of 0.0" in str(shed.error) and pool.snapshot().stats.shed[1] == 1
        assert not any(c.done.is_set() for c in paid)  # paid is untouched
        for ticket in tickets:
            pool.cancel(ticket)
