"""A test's side of the continuous-mode engine pool: the jobs it submits (``job``, with the tier
budgets ``QUEUE``) and the caller that records every event each job is given (``Client``). The
virtual-time tests and the real-process ones submit the same jobs through the same caller."""

from __future__ import annotations

import trio

from batcher.core.backend import Delta, Failed, Finished, Job
from batcher.core.config import QueueConfig

QUEUE = QueueConfig(wait_budgets=(10.0, 10.0))


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
    return Job(prompt.decode(), tuple(prompt), max_tokens, "paid", "acme", stream=stream, **fields)
