"""A real engine in a step far longer than its stats timeout is not taken for hung.

The production pool over one SmolLM2-135M engine process (float32, one torch thread) with a
1-second ``stats_timeout_ms``: a 1,024-token prompt's prefill is one step of several seconds on
this CPU, during which the engine sends no ``stats``. The engine announces the step as it starts
(its figure from the steps it measured for a shorter prompt first), the pool allows it that
step's limit, and the answer comes back with no engine restarted. Without the announcement the
engine is killed at every try of that step and the request fails. The pool's rule, with exact
times, is ``tests/pure/test_step_silence.py``; nothing here asserts speed.
"""

from __future__ import annotations

import contextlib

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Finished, Job, Sampling
from batcher.core.config import QueueConfig
from batcher.placement.local import process_workers
from gateway.text.tokenizer import make_tokenizer
from tests.support.engine_pool import Client

QUEUE = QueueConfig(wait_budgets=(120.0, 120.0))  # no request is refused for the engine's slowness
SENTENCE = "The ferry left the harbour at noon, and the gulls followed it out past the lighthouse. "


@contextlib.asynccontextmanager
async def smollm2_pool(model: str):
    config = ContinuousModelConfig(
        name="smollm2@1", model=model, workers=1, threads=1, dtype="float32", num_blocks=160,
        max_batch_tokens=2048, max_seqs=4, temperature=0.0, stats_timeout_ms=1000,
    )
    spawn = process_workers(config.engine_argv(), 1, kind=EngineProcess)
    async with open_engine_pool(config, QUEUE, spawn, make_tokenizer(config.tokenizer)) as pool:
        yield pool


def prompt(tokenizer, tokens: int) -> Job:
    """A job whose prompt is ``tokens`` tokens of prose, answered greedily in 4 tokens."""
    ids = tuple((tokenizer.encode(SENTENCE * (tokens // 10)))[:tokens])
    assert len(ids) == tokens
    return Job(tokenizer.decode(list(ids)), ids, Sampling(4, temperature=0.0), "paid", "acme")


async def answer(pool, job: Job) -> Client:
    client = Client()
    pool.submit(job, client)
    with trio.fail_after(300):
        await client.done.wait()
    return client


async def test_an_engine_in_a_prefill_step_longer_than_its_stats_timeout_survives_and_answers(smollm2):
    tokenizer = make_tokenizer(smollm2)
    async with smollm2_pool(smollm2) as pool:
        short = await answer(pool, prompt(tokenizer, 200))  # the engine measures its steps
        long = await answer(pool, prompt(tokenizer, 1024))  # one prefill step of seconds
        assert pool.snapshot().counters.restarts == 0
    for client in (short, long):
        assert isinstance(client.events[-1], Finished), client.events[-1]
        assert client.events[-1].usage.output_tokens == 4
