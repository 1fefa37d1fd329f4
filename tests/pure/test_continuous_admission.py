"""Continuous admission fails fast: a burst that one engine cannot start within the tier's budget
is shed at arrival with a Retry-After, and every request admitted starts and finishes; none fails
after waiting its whole budget (what the embedded default did to 13-19 of 32 requests).

Logic, in virtual time (MockClock): the pool, its router, admission and dispatch are the real
ones, and so is ferry's engine (scheduler, block manager, its frames), run as the simulated
engine process of :mod:`batcher.sim.continuous.engine`; only the forward pass is priced, as SmolLM2
in bfloat16 ran on a 2-core CPU: about 50 ms a step (its weights read) or 1.5 ms a token
computed, whichever is more.
"""

from __future__ import annotations

import math

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling, Started
from batcher.core.config import QueueConfig
from batcher.core.errors import Expired, Shed
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.text.tokenizer import ByteTokenizer
from workers.engine.cost_model import PRESETS, CostModel, Hardware

SMOLLM2 = PRESETS["smollm2-135m"].shape
CPU = Hardware("2-core CPU", bandwidth=SMOLLM2.weight_bytes / 0.05, flops=2 * SMOLLM2.params / 0.0015)


def cpu_engines(config: ContinuousModelConfig) -> SimulatedEngines:
    return SimulatedEngines(EngineSpec.of(config, cost=CostModel(SMOLLM2, CPU)))


class Client:
    """One request's caller: its events, and the virtual time of each."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = trio.Event()

    def __call__(self, event) -> None:
        self.events.append((trio.current_time(), event))
        if isinstance(event, Finished | Failed):
            self.done.set()

    def first(self, kind: type) -> float:
        return next(at for at, event in self.events if isinstance(event, kind))


def burst(n: int, offset: int = 0) -> list[Job]:
    """``n`` chat requests as the HTTP benchmark sends them: a quarter of them long documents."""
    jobs = []
    for i in range(n):
        words = 600 if i % 4 == 0 else 40
        prompt = bytes((offset + i * 7 + k) % 90 + 32 for k in range(words))
        jobs.append(Job(prompt.decode(), tuple(prompt), Sampling(128), "paid", "acme", stream=True))
    return jobs


async def serve_burst(pool, jobs: list[Job]) -> tuple[list[Client], float]:
    clients = [Client() for _ in jobs]
    arrival = trio.current_time()
    for job, client in zip(jobs, clients, strict=True):
        pool.submit(job, client)
    for client in clients:
        await client.done.wait()
    return clients, arrival


def model(max_batch_tokens: int) -> ContinuousModelConfig:
    return ContinuousModelConfig(name="cpu@1", simulated="smollm2-135m", num_blocks=4096,
                                 max_batch_tokens=max_batch_tokens, max_seqs=256)


@pytest.mark.parametrize("max_batch_tokens", [256, 2048])
async def test_no_request_of_a_burst_fails_after_waiting_its_whole_budget(max_batch_tokens, autojump_clock):
    config = model(max_batch_tokens)
    async with open_engine_pool(config, QueueConfig(wait_budgets=(1.0,), tiers=("paid",)),
                                cpu_engines(config), ByteTokenizer()) as pool:
        for round_ in range(3):  # cold (nothing measured: all admitted), then warm: the estimate decides
            clients, arrival = await serve_burst(pool, burst(32, offset=round_))
            for client in clients:
                (at, last) = client.events[-1]
                if isinstance(last, Failed):
                    assert isinstance(last.error, Shed) and not isinstance(last.error, Expired), last
                    assert at == arrival and len(client.events) == 1  # shed at arrival, nothing else
                    assert 0 < last.error.retry_after < math.inf
                else:
                    assert isinstance(last, Finished) and client.first(Started) >= arrival
                    assert sum(e.tokens for _, e in client.events if isinstance(e, Delta)) == 128
            assert pool.snapshot().counters.expired == 0


async def test_a_warm_burst_beyond_the_budget_is_shed_at_arrival_and_the_admitted_start_in_it(autojump_clock):
    config = model(256)
    async with open_engine_pool(config, QueueConfig(wait_budgets=(1.0,), tiers=("paid",)),
                                cpu_engines(config), ByteTokenizer()) as pool:
        await serve_burst(pool, burst(32))  # the rate is measured from here on
        clients, arrival = await serve_burst(pool, burst(96, offset=1))
        shed = [c for c in clients if isinstance(c.events[-1][1], Failed)]
        served = [c for c in clients if c not in shed]
        assert shed and served and all(c.events[0][0] == arrival for c in shed)
        assert all(next(e.queued for _, e in c.events if isinstance(e, Started)) <= 1.0 for c in served)



async def test_a_retune_gives_admission_the_new_budgets_and_keeps_the_tiers(autojump_clock):
    config = model(256)
    async with open_engine_pool(config, QueueConfig(wait_budgets=(1.0,), tiers=("paid",)),
                                cpu_engines(config), ByteTokenizer()) as pool:
        pool.retune(QueueConfig(wait_budgets=(5.0,), tiers=("paid",)))
        assert pool.admission.budgets == (5.0,) and pool.queue_config.deadline(0) == 5.0
        with pytest.raises(ValueError, match="tiers"):
            pool.retune(QueueConfig(wait_budgets=(5.0, 9.0), tiers=("paid", "free")))
