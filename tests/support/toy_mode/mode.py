"""The toy mode's backend and registry entry (see the package's docstring)."""

from __future__ import annotations

import contextlib
import dataclasses

import trio
from prometheus_client.core import CounterMetricFamily

from batcher.core.admission import BatchLoad
from batcher.core.backend import Delta, Finished, Snapshot, Started, Status, Usage
from batcher.core.counters import Counters
from batcher.core.mode import Mode
from tests.support.toy_mode.config import ToyModelConfig

PREPARED: list[tuple[str, bool]] = []
"""(model, prepared inside a trio run) for each preparation, in order."""


@dataclasses.dataclass(slots=True)
class ToyCounters(Counters):
    answers: int = 0


class ToyBackend:
    def __init__(self, model: ToyModelConfig, tokenizer) -> None:
        self.model, self.tokenizer, self.counters = model, tokenizer, ToyCounters()

    def submit(self, job, on_event) -> object:
        text = job.prompt.rsplit("User: ", 1)[-1].upper() + self.model.suffix
        self.counters.answers += 1
        on_event(Started(0.0))
        on_event(Delta(text, self.tokenizer.count(text)))
        on_event(Finished("end_turn", Usage(len(job.prompt_tokens), 0, self.tokenizer.count(text))))
        return None

    def cancel(self, ticket: object) -> None:
        pass

    def load(self) -> BatchLoad:
        return BatchLoad((0,), (0.0,), 1, 0.0)

    def snapshot(self) -> Snapshot:
        status = Status(True, "", (), 0, "shouts", {"answers": self.counters.answers})
        return Snapshot("toy", status, self.counters.copy(), self.load())

    def retune(self, queue) -> None:
        pass


async def prepare(model: ToyModelConfig) -> None:
    try:
        trio.lowlevel.current_trio_token()
        in_trio = True
    except RuntimeError:
        in_trio = False
    PREPARED.append((model.name, in_trio))


@contextlib.asynccontextmanager
async def open_toy(model: ToyModelConfig, queue, spawn, tokenizer):
    assert callable(spawn)  # the registry's one worker factory, unused by a mode without workers
    yield ToyBackend(model, tokenizer)


def families(backends):
    answers = CounterMetricFamily("ferry_toy_answers", "Answers the toy shouted.", labels=["model"])
    for model, _, snapshot in backends:
        answers.add_metric([model], snapshot.counters.answers)
    yield answers


MODE = Mode(argv=lambda model: ["echo"], process=object, open=open_toy, prepare=prepare,
            families=families)
