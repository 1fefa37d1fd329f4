"""``add`` / ``abort`` / ``step``: the scheduler and block manager driving a runner.

One :meth:`Engine.step` asks the scheduler what to compute, has the runner compute it (a
model's runner lays it out as a :class:`~workers.engine.batch.ForwardBatch`), and hands the
sampled tokens back to the scheduler. Everything a batch says about a sequence is derived afresh from
that sequence alone, every step: its positions start at its own ``num_computed``, its slots come
from its own block table, its context length is its own. Nothing is carried over from whichever
sequence last used the same blocks, which is how continuous batching's classic "new request
inherits the old one's position offset" bug cannot happen here (``tests/engine/test_engine_core.py`` pins it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from workers.engine.batch import Runner
from workers.engine.config import EngineConfig
from workers.engine.cost_model import CostModel
from workers.engine.interface import SequenceEnd, StepOutput, StepWatch
from workers.engine.scheduler import Schedule, Scheduler
from workers.engine.sequence import Sequence
from workers.protocol import EngineStats, Usage
from workers.sampling import Sampling

GREEDY = Sampling()


class Engine:
    """The continuous engine over one runner (a model in a worker, or a simulation): an
    :class:`~workers.engine.interface.EngineCore`."""

    def __init__(
        self, runner: Runner, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
        cost: CostModel | None = None,
    ) -> None:
        """``cost`` prices this runner's steps, for the sequences' TPOT targets (None: not held)."""
        if config.block_size != runner.block_size or config.num_blocks > runner.num_blocks:
            raise ValueError(
                f"EngineConfig: block_size {config.block_size} and num_blocks {config.num_blocks} must fit "
                f"the runner's cache ({runner.num_blocks} blocks of {runner.block_size})"
            )
        self.runner, self.config, self.clock = runner, config, clock
        self.scheduler = Scheduler(config, runner.eos_token_ids, runner.max_model_len, cost)
        self._rids = itertools.count()
        self.steps = self.computed_tokens = self.generated_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.sequences or self.scheduler.finished)

    def add(
        self,
        prompt_ids: list[int],
        sampling: Sampling = GREEDY,
        *,
        tier: int = 0,
        tenant: str = "",
        rid: int | None = None,
        weight: float = 1.0,
        output_ids: Iterable[int] = (),
        tpot_target: float = 0.0,
    ) -> int:
        """Queue a sequence; returns its rid (``rid``, or the next free number). It runs from the
        next step on; one that could never fit the cache is reported finished by that step. A
        resumed one (``output_ids``) is a sequence preempted by recompute: its prompt and output
        are computed again, and its next token is sampled as its ``len(output_ids)``-th."""
        if rid is None:
            rid = next(r for r in self._rids if r not in self.scheduler.sequences)
        seq = Sequence(rid, list(prompt_ids), sampling, tier=tier, tenant=tenant, arrival=self.clock(),
                       weight=weight, output_ids=list(output_ids), tpot_target=tpot_target)
        self.scheduler.add(seq)
        return rid

    def abort(self, rid: int) -> bool:
        """End ``rid`` (False if unknown): its blocks are free before the next step runs."""
        return self.scheduler.abort(rid, self.clock())

    def step(self, watch: StepWatch | None = None) -> StepOutput:
        scheduler = self.scheduler
        schedule = scheduler.schedule(self.clock())
        tokens: dict[int, int] = {}
        if schedule.seqs:
            if watch is not None:
                watch.begin(schedule.num_tokens, context_lens(schedule))
            sampled = self.runner.run(schedule)
            if watch is not None:
                watch.end()
            tokens = scheduler.postprocess(schedule, sampled, self.clock())
            self.steps += 1
        scheduled = sum(schedule.num_tokens)
        self.computed_tokens += scheduled
        self.generated_tokens += len(tokens)
        finished = []
        if scheduler.finished:
            finished = [self._finished(seq) for seq in scheduler.finished]
            scheduler.finished = []
        return StepOutput(tokens, finished, [seq.rid for seq in schedule.preempted], scheduled)

    def stats(self) -> EngineStats:
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        return EngineStats(
            step=self.steps,
            running=len(scheduler.running),
            waiting=scheduler.num_waiting,
            free_blocks=blocks.num_free,
            used_blocks=blocks.num_used,
            total_blocks=blocks.num_blocks,
            cached_blocks=blocks.num_evictable,
            preemptions=scheduler.preemptions,
            prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
        )

    def _finished(self, seq: Sequence) -> SequenceEnd:
        assert seq.finish_reason is not None
        detail = self.scheduler.details.pop(seq.rid, "")
        usage = Usage(seq.num_prompt, seq.num_cached, len(seq.output_ids))
        return SequenceEnd(seq.rid, seq.finish_reason, usage, detail)


def context_lens(schedule: Schedule) -> list[int]:
    """The tokens each sequence of ``schedule`` holds once its step has run."""
    return [seq.num_computed + n for seq, n in zip(schedule.seqs, schedule.num_tokens, strict=True)]
