"""The engine pool over real engine worker processes: smoke tests of what virtual time cannot
show (simulated engines in child processes, each step as long as a 70B model on 8 x H100 would
take): a SIGKILL under streams and whole answers, engines that cannot start, and one step's
tokens crossing the bridge to the HTTP side together. The pool's logic, with exact times, is
``tests/pure/test_engine_pool.py``.

The real clock runs these (subprocess I/O); bounds are generous and nothing asserts speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.supervisor import WorkerStartError
from batcher.placement.local import process_workers
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import QUEUE
from tests.support.harness import KEY, ScriptedBackend, in_process, run, sse
from tests.support.processes import worker_pids
from tests.support.replica_loss import check_replica_0_lost, place_streams_and_wholes
from tests.support.waiting import until_asyncio, until_trio


@contextlib.asynccontextmanager
async def engines(workers: int = 2):
    config = ContinuousModelConfig(
        name="sim@1", simulated="llama-70b", workers=workers, num_blocks=64, max_batch_tokens=64, max_seqs=16
    )
    spawn = process_workers(config.engine_argv(), workers, kind=EngineProcess)
    async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()) as pool:
        yield pool


async def test_a_killed_engine_ends_its_streams_that_sent_text_and_reruns_the_rest_unseen_elsewhere():
    async with engines(workers=2) as pool:
        streams, wholes = place_streams_and_wholes(pool)
        await until_trio(lambda: all(c.delivered for c in streams), "text on every stream")
        os.kill(worker_pids(pool)[0], signal.SIGKILL)
        with trio.fail_after(30):
            await check_replica_0_lost(pool, streams, wholes)


async def test_engines_that_cannot_start_fail_the_pool_start_with_one_error_naming_the_model():
    config = ContinuousModelConfig(name="sim@1", simulated="llama-70b", workers=2)
    spawn = process_workers([*config.engine_argv(), "--no-such-flag"], 2, kind=EngineProcess)
    reason = r"sim@1: 2 of 2 workers did not start; first: worker 0: WorkerLost\('pid \d+ exited with code"
    with pytest.RaisesGroup(pytest.RaisesExc(WorkerStartError, match=reason), flatten_subgroups=True):
        async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()):
            pass  # pragma: no cover - never reached


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
                request = {
                    "model": "sim@1",
                    "max_tokens": 30,
                    "stream": True,
                    "messages": [{"role": "user", "content": f"stream {index}"}],
                }
                response = await client.post("/v1/messages", json=request, headers={"x-api-key": KEY})
                return sse(await response.read())

            streams = await asyncio.gather(*(one(i) for i in range(16)))
            hops = bridge.hops_to_asyncio  # every token has crossed: the streams are whole

            async def reported():
                snapshot = (await bridge.snapshots())["sim@1"]
                engine = snapshot.counters.replicas[0].engine
                return snapshot if engine.running == 0 and engine.generated_tokens >= 16 * 30 else None

            snapshot = await until_asyncio(reported, "the engine's report of its last steps", within=10)
            return streams, hops, snapshot.counters.step_tokens.count

    streams, hops, steps = run(body)
    texts = [
        "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
        for events in streams
    ]
    assert all(len(text) == 30 for text in texts)
    assert 30 <= steps and hops <= steps + 16  # 480 tokens crossed in about a hop per step, not 480 hops
