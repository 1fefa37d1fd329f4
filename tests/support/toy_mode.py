"""A third serving mode, built the way a real one would be: a config class, a preparation step,
a backend and its own metric family, handed to the registry as one :class:`~batcher.core.mode.Mode`.
Not a test module (``tests/system/test_modes.py`` registers it).

The toy's backend answers each job at once with its prompt shouted (upper case, its own
``suffix`` after it), on the trio thread, without worker processes: what it shows is that the
core reaches a mode only through its registry entry. Its preparation notes, per model, whether
it ran inside the trio core, which is where start-up and a reload must both prepare.
"""

from __future__ import annotations

import contextlib
import dataclasses

import trio
from prometheus_client.core import CounterMetricFamily

from batcher.core.admission import BatchLoad
from batcher.core.backend import Delta, Finished, Snapshot, Started, Status, Usage
from batcher.core.config import ModelConfig, _require
from batcher.core.mode import Mode
from batcher.core.stats import CoreStats

PREPARED: list[tuple[str, bool]] = []
"""(model, prepared inside a trio run) for each preparation, in order."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ToyModelConfig(ModelConfig):
    """A toy model: ``suffix`` is what every answer ends with."""

    mode: str = "toy"
    suffix: str = "!"
    workers: int = 1

    def __post_init__(self) -> None:
        super(ToyModelConfig, self).__post_init__()
        _require(len(self.suffix) <= 3, "suffix", "at most 3 characters", self.suffix)


@dataclasses.dataclass(slots=True)
class ToyStats(CoreStats):
    answers: int = 0


class ToyBackend:
    def __init__(self, model: ToyModelConfig, tokenizer) -> None:
        self.model, self.tokenizer, self.stats = model, tokenizer, ToyStats()

    def submit(self, job, on_event) -> object:
        text = job.prompt.rsplit("User: ", 1)[-1].upper() + self.model.suffix
        self.stats.answers += 1
        on_event(Started(0.0))
        on_event(Delta(text, self.tokenizer.count(text)))
        on_event(Finished("end_turn", Usage(len(job.prompt_tokens), 0, self.tokenizer.count(text))))
        return None

    def cancel(self, ticket: object) -> None:
        pass

    def load(self) -> BatchLoad:
        return BatchLoad((0,), (0.0,), 1, 0.0)

    def snapshot(self) -> Snapshot:
        status = Status(True, "", (), 0, "shouts", {"answers": self.stats.answers})
        return Snapshot("toy", status, self.stats.copy(), self.load())

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
        answers.add_metric([model], snapshot.stats.answers)
    yield answers


MODE = Mode(ToyModelConfig, argv=lambda model: ["echo"], process=object, open=open_toy, prepare=prepare,
            families=families)
