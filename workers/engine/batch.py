"""What runs an engine step (:class:`Runner`), and the flat batch a model reads (:class:`ForwardBatch`).

The scheduler decides which tokens of which sequences a step computes (a ``Schedule``); a runner
computes them and samples. A model's runner (:class:`BatchRunner`) lays the step out as one
:class:`ForwardBatch`, flat lists of ints that any model reads without knowing about sequences or
blocks (a runner that only prices steps reads the schedule). Sequence ``i`` of the batch owns
tokens ``input_ids[sum(query_lens[:i]) : sum(query_lens[:i + 1])]``::

    sequence        A (decode)   B (prefill chunk, 3 tokens)   C (decode)
    input_ids       [a9          b0  b1  b2                   c4]
    positions       [9           0   1   2                    4 ]
    query_lens      [1,          3,                           1 ]
    context_lens    [10,         3,                           5 ]   KV held after this step

The runner writes each token's K and V to ``slot_mapping`` (``block * block_size + offset``),
then lets each query attend to its own sequence's first ``context_lens[i] - query_lens[i]``
cached tokens plus, causally, the ones of its own chunk.

What a runner may assume, and the torch runner checks: each sequence's positions are
contiguous, ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``, so its last token sits
at ``context_lens[i] - 1`` (the attention mask comes from positions alone: a token sees keys
``0 .. position``), and its block table covers its whole context.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from workers.engine.scheduler import Schedule
from workers.engine.sequence import Sequence as EngineSequence
from workers.sampling import Sampling


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """How to pick a sequence's next token: its parameters and which output token this is.

    ``index`` is the number of output tokens the sequence already has. A seeded sampler draws
    from a generator keyed by ``(seed, index)``, so a token depends neither on the sequence's
    batch mates nor on whether it was preempted and recomputed. A penalty reads the sequence's
    tokens: its ``output`` (and ``prompt``, for the repetition penalty), the sequence's own
    lists, handed over only when its sampling has a penalty.
    """

    params: Sampling
    index: int
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's tokens for the model, sequence by sequence (see the module's picture)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    samples: list[Sample | None]
    """Per sequence: how to sample its next token, or None for a prefill chunk that stops short
    of the sequence's last token (it produces no token this step)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class Runner(Protocol):
    """Runs an engine's steps: the torch model in a worker, or a runner that prices them."""

    block_size: int
    num_blocks: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    """The longest sequence (prompt and answer) the model can attend over: its context."""

    def run(self, schedule: Schedule) -> list[int | None]:
        """Compute one step, before its sequences' ``num_computed`` moves on: the next token of
        each scheduled sequence whose chunk ends at its last token, None for the others."""


class BatchRunner:
    """A runner of laid-out batches: :meth:`run` lays the step out (:func:`forward_batch`) and
    hands it to :meth:`execute`."""

    block_size: int

    def run(self, schedule: Schedule) -> list[int | None]:
        return self.execute(forward_batch(schedule, self.block_size))

    def execute(self, batch: ForwardBatch) -> list[int | None]:
        """The next token of each sequence whose ``samples[i]`` is set, None for the others."""
        raise NotImplementedError


def _sample(seq: EngineSequence) -> Sample:
    if seq.sampling.penalized:
        return Sample(seq.sampling, len(seq.output_ids), seq.prompt_ids, seq.output_ids)
    return Sample(seq.sampling, len(seq.output_ids))


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
        samples.append(_sample(seq) if end == seq.num_tokens else None)
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
