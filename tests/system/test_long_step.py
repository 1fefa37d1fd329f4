"""A real engine in a step far longer than its stats timeout is not taken for hung.

The production pool over one SmolLM2-135M engine process (ferry's engine in float32, or vLLM's in
bfloat16 where its virtualenv is built; one thread) with a 1-second ``stats_timeout_ms``: a long
prompt's prefill is one step of seconds on this CPU (a 2,000-token one for vLLM's, faster per
token), during which the engine sends no ``stats``. The engine announces the step as it starts
(its figure from the steps it measured for a shorter prompt first), the pool allows it that
step's limit, and the answer comes back with no engine restarted. vLLM's adapter announces
what it expects vLLM's step to compute (``workers/vllm_step.py``), timed the same way. Without
the announcement the engine is killed at every try of that step and the request fails. The
pool's rule, with exact times, is ``tests/pure/test_step_silence.py``; nothing here asserts speed.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Finished, Job, Sampling
from batcher.core.config import QueueConfig
from batcher.placement.local import process_workers
from gateway.text.tokenizer import make_tokenizer
from tests.support.engine_pool import Client
from tests.support.vllm_server import VLLM_PYTHON, vllm_installed

QUEUE = QueueConfig(wait_budgets=(120.0, 120.0))  # no request is refused for the engine's slowness
SENTENCE = "The ferry left the harbour at noon, and the gulls followed it out past the lighthouse. "


ENGINES = {  # the engine's table, and the tokens of a prompt whose prefill is one step of seconds
    "ferry": (dict(dtype="float32", num_blocks=160), 1024),
    "vllm": (dict(engine="vllm", python=str(VLLM_PYTHON), dtype="bfloat16", kv_memory_gb=0.25,
                  context_window=2048), 2000),
}
VLLM = pytest.mark.skipif(not vllm_installed(), reason="vLLM's virtualenv .venv-vllm is not built here")


@contextlib.asynccontextmanager
async def smollm2_pool(model: str, engine: str):
    config = ContinuousModelConfig(
        name="smollm2@1", model=model, workers=1, threads=1, max_batch_tokens=2048, max_seqs=4,
        temperature=0.0, stats_timeout_ms=1000, **ENGINES[engine][0],
    )
    spawn = process_workers(config.engine_argv(), 1, kind=EngineProcess, python=config.interpreter)
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


@pytest.mark.parametrize("engine", ["ferry", pytest.param("vllm", marks=VLLM)])
async def test_an_engine_in_a_prefill_step_longer_than_its_stats_timeout_survives_and_answers(
        smollm2, engine):
    tokenizer = make_tokenizer(smollm2)
    async with smollm2_pool(smollm2, engine) as pool:
        short = await answer(pool, prompt(tokenizer, 200))  # the engine measures its steps
        long = await answer(pool, prompt(tokenizer, ENGINES[engine][1]))  # one prefill step of seconds
        assert pool.snapshot().counters.restarts == 0
    for client in (short, long):
        assert isinstance(client.events[-1], Finished), client.events[-1]
        assert client.events[-1].usage.output_tokens == 4
