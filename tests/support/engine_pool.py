"""A test's side of the continuous-mode engine pool: the pool over simulated engines in virtual
time (``engines``), the jobs it submits (``job``, with the tier budgets ``QUEUE``) and the caller
that records every event each job is given (``Client``). The real-process tests submit the same
jobs through the same caller."""

from __future__ import annotations

import contextlib

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling
from batcher.core.config import QueueConfig
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.text.tokenizer import ByteTokenizer

QUEUE = QueueConfig(wait_budgets=(10.0, 10.0))


@contextlib.asynccontextmanager
async def engines(workers: int = 2, eos_prob: float = 0.0, queue: QueueConfig = QUEUE, **settings):
    """The production pool of ``sim@1`` over simulated 70B engines (64 blocks, 64 tokens a step,
    16 sequences unless ``settings`` say otherwise); yields the pool and its spawn."""
    config = ContinuousModelConfig(
        name="sim@1",
        simulated="llama-70b",
        workers=workers,
        **{"num_blocks": 64, "max_batch_tokens": 64, "max_seqs": 16, **settings},
    )
    spawn = SimulatedEngines(EngineSpec.of(config, eos_prob=eos_prob))
    async with open_engine_pool(config, queue, spawn, ByteTokenizer()) as pool:
        yield pool, spawn


class Client:
    """One job's caller: every event it was given, when, and whether it has its last."""

    def __init__(self) -> None:
        self.events: list = []
        self.times: list[float] = []
        self.done = trio.Event()

    def __call__(self, event) -> None:
        assert not self.done.is_set(), f"{event} after the end"
        self.events.append(event)
        self.times.append(trio.current_time())
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def delivered(self) -> int:
        return sum(e.tokens for e in self.events if isinstance(e, Delta))

    @property
    def ended(self) -> float:
        assert self.done.is_set()
        return self.times[-1]


def job(seed: int, max_tokens: int, stream: bool, length: int = 10, **fields) -> Job:
    """A paid job of ``length`` printable prompt bytes drawn from ``seed``."""
    prompt = bytes((seed * 7 + i) % 90 + 32 for i in range(length))
    return Job(prompt.decode(), tuple(prompt), Sampling(max_tokens), "paid", "acme", stream=stream, **fields)
