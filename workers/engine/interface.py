"""What the serving loop needs of an engine, and what every engine's step returns: pure values.

:class:`EngineCore` (vLLM names its own the same) is the whole of it: ``add`` and ``abort``
sequences, ``step`` once (a :class:`StepWatch` seeing it begin and end), report ``stats``, and
say whether it ``has_work``. ferry's :class:`~workers.engine.engine.Engine`, vLLM's adapter
(``workers/vllm_engine.py``) and the simulated engine of ``batcher.sim`` implement it, and one
loop (:mod:`workers.engine.loop`) serves them all. Torch-free and numpy-free: vLLM's interpreter
imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from workers.engine.sequence import FinishReason
from workers.protocol import EngineStats, Usage
from workers.sampling import Sampling


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceEnd:
    """A sequence that ended: why, and the tokens it used (``detail`` says more for TOO_LONG)."""

    rid: int
    reason: FinishReason
    usage: Usage
    detail: str = ""


class StepOutput(NamedTuple):
    """What one step produced: each sequence's new token, the sequences that ended, those it
    preempted, and how many tokens it computed (a named tuple: immutable, and cheap to make)."""

    tokens: dict[int, int]
    finished: list[SequenceEnd]
    preempted: list[int]
    scheduled_tokens: int


class StepWatch(Protocol):
    """What sees each step's start and end: the forecast that tells the pool of a long step
    before it runs (:class:`workers.engine.step_forecast.StepForecast`)."""

    def begin(self, query_lens: list[int], context_lens: list[int]) -> None:
        """A step starts that computes ``query_lens[i]`` tokens of sequence ``i``, which then
        holds ``context_lens[i]``."""

    def end(self) -> None:
        """The step begun last has ended."""


class EngineCore(Protocol):
    """An engine as the serving loop drives it, one call at a time."""

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: a sequence runs or waits, or one ended unreported."""

    def add(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        tier: int = 0,
        tenant: str = "",
        rid: int | None = None,
        weight: float = 1.0,
        output_ids: Sequence[int] = (),
        tpot_target: float = 0.0,
    ) -> int:
        """Queue a sequence (as ``rid``, or a free number); returns its rid. ValueError for one it
        refuses outright; one too long for it ends at the next step. ``weight`` is its tenant's
        within its tier, where the engine shares a tier's queue among tenants. ``output_ids``: what
        the sequence generated on an engine that died; it continues after them. ``tpot_target``:
        the seconds per output token its tier promises (0: none), where the engine holds it."""

    def abort(self, rid: int) -> bool:
        """End ``rid`` at the next step (False if it holds no such sequence)."""

    def step(self, watch: StepWatch | None = None) -> StepOutput:
        """Run one step; ``watch`` sees it begin (once the engine knows what it computes) and
        end, where the engine can say (vLLM's adapter cannot: its steps are not watched)."""

    def stats(self) -> EngineStats:
        """Its load now, and its counters since it started."""
