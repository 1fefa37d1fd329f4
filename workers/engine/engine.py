"""``add`` / ``abort`` / ``step``: the scheduler and block manager driving a runner.

One :meth:`Engine.step` asks the scheduler what to compute, turns that into a
:class:`~workers.engine.batch.ForwardBatch`, has the runner execute it, and hands the sampled
tokens back to the scheduler. Everything a batch says about a sequence is derived afresh from
that sequence alone, every step: its positions start at its own ``num_computed``, its slots come
from its own block table, its context length is its own. Nothing is carried over from whichever
sequence last used the same blocks, which is how continuous batching's classic "new request
inherits the old one's position offset" bug cannot happen here (``tests/engine/test_engine_core.py`` pins it).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import numpy as np

from workers.engine.batch import ForwardBatch, Runner, Sample
from workers.engine.config import EngineConfig
from workers.engine.scheduler import Schedule, Scheduler
from workers.engine.sequence import FinishReason, SamplingParams, Sequence
from workers.protocol import EngineStats

GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceEnd:
    """A sequence that ended: why, and its usage in tokens (``detail`` says more for TOO_LONG)."""

    rid: int
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    detail: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced: each sequence's new token, the sequences that ended, how many
    tokens it computed (the load is :meth:`Engine.stats`, computed only when asked for)."""

    tokens: dict[int, int]
    finished: list[SequenceEnd]
    preempted: list[int]
    scheduled_tokens: int


def forward_batch(schedule: Schedule, block_size: int) -> ForwardBatch:
    """The flat batch for ``schedule``, before its sequences' ``num_computed`` moves on.

    Positions and slots are computed for the whole batch at once with numpy (a long prompt
    chunk is thousands of tokens): token ``t`` of sequence ``s`` at position ``p`` goes to
    ``table_s[p // block_size] * block_size + p % block_size``, every table laid end to end.
    """
    input_ids, query_lens, context_lens, tables, samples = [], [], [], [], []
    for seq, n in zip(schedule.seqs, schedule.num_tokens, strict=True):
        start, end = seq.num_computed, seq.num_computed + n
        input_ids += seq.tokens(start, end)
        query_lens.append(n)
        context_lens.append(end)
        tables.append(list(seq.block_table))
        samples.append(Sample(seq.sampling, len(seq.output_ids)) if end == seq.num_tokens else None)
    counts, ends = np.array(query_lens), np.array(context_lens)
    first_token = np.cumsum(counts) - counts  # each sequence's first index in the flat batch
    positions = np.arange(len(input_ids)) + np.repeat(ends - counts - first_token, counts)
    table_starts = np.cumsum([0] + [len(table) for table in tables[:-1]])
    flat_tables = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64)
    blocks = flat_tables[np.repeat(table_starts, counts) + positions // block_size]
    slots = blocks * block_size + positions % block_size
    return ForwardBatch(
        input_ids, positions.tolist(), slots.tolist(), query_lens, context_lens, tables, samples
    )


class Engine:
    """The continuous engine over one runner (a model in a worker, or a simulation)."""

    def __init__(
        self, runner: Runner, config: EngineConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if config.block_size != runner.block_size or config.num_blocks > runner.num_blocks:
            raise ValueError(
                f"EngineConfig: block_size {config.block_size} and num_blocks {config.num_blocks} must fit "
                f"the runner's cache ({runner.num_blocks} blocks of {runner.block_size})"
            )
        self.runner, self.config, self.clock = runner, config, clock
        self._keeps_kv = getattr(runner, "keeps_kv", True)  # see the Runner protocol
        self.scheduler = Scheduler(config, runner.eos_token_ids, runner.max_model_len)
        self._rids = itertools.count()
        self.steps = self.computed_tokens = self.generated_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.sequences or self.scheduler.finished)

    def add(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams = GREEDY,
        *,
        tier: int = 0,
        tenant: str = "",
        rid: int | None = None,
    ) -> int:
        """Queue a sequence; returns its rid (``rid``, or the next free number). It runs from the
        next step on; one that could never fit the cache is reported finished by that step."""
        if rid is None:
            rid = next(r for r in self._rids if r not in self.scheduler.sequences)
        seq = Sequence(rid, list(prompt_ids), sampling, tier=tier, tenant=tenant, arrival=self.clock())
        self.scheduler.add(seq)
        return rid

    def abort(self, rid: int) -> bool:
        """End ``rid`` (False if unknown): its blocks are free before the next step runs."""
        return self.scheduler.abort(rid, self.clock())

    def step(self) -> StepOutput:
        scheduler = self.scheduler
        schedule = scheduler.schedule(self.clock())
        tokens: dict[int, int] = {}
        if schedule.seqs:
            if self._keeps_kv:
                sampled = self.runner.execute(forward_batch(schedule, self.config.block_size))
            else:  # a priced runner reads the schedule itself: no batch to lay out
                sampled = self.runner.execute_schedule(schedule)  # type: ignore[attr-defined]
            tokens = scheduler.postprocess(schedule, sampled, self.clock())
            self.steps += 1
        scheduled = sum(schedule.num_tokens)
        self.computed_tokens += scheduled
        self.generated_tokens += len(tokens)
        finished = self.take_finished()
        preempted = [seq.rid for seq in schedule.preempted]
        return StepOutput(tokens, finished, preempted, scheduled)

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

    def take_finished(self) -> list[SequenceEnd]:
        """The sequences that ended since this was last called (a step calls it for its output;
        a replay that advances decode steps itself, :mod:`batcher.sim.continuous.jump`, calls it after)."""
        finished = [self._finished(seq) for seq in self.scheduler.finished]
        self.scheduler.finished = []
        return finished

    def _finished(self, seq: Sequence) -> SequenceEnd:
        assert seq.finish_reason is not None
        detail = self.scheduler.details.pop(seq.rid, "")
        return SequenceEnd(
            seq.rid, seq.finish_reason, seq.num_prompt, seq.num_cached, len(seq.output_ids), detail
        )
