"""What one engine step hands the model, and the protocol of whatever runs it: pure values.

The scheduler decides which tokens of which sequences are computed this step; the engine turns
that into one :class:`ForwardBatch`, flat lists of ints that any runner can read without knowing
about sequences or blocks. Sequence ``i`` of the batch owns tokens
``input_ids[sum(query_lens[:i]) : sum(query_lens[:i + 1])]``::

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
from typing import Protocol

from workers.engine.sequence import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """How to pick a sequence's next token: its parameters and which output token this is.

    ``index`` is the number of output tokens the sequence already has. A seeded sampler draws
    from a generator keyed by ``(seed, index)``, so a token depends neither on the sequence's
    batch mates nor on whether it was preempted and recomputed.
    """

    params: SamplingParams
    index: int


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
    """Runs a :class:`ForwardBatch`: the torch model in a worker, or a simulation of one."""

    block_size: int
    num_blocks: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    """The longest sequence (prompt and answer) the model can attend over: its context."""
    # A runner may also say ``keeps_kv = False`` (the simulated one, which only prices a step):
    # the engine then hands it the step's Schedule (``execute_schedule``) instead of a batch,
    # whose positions, slots and block tables it would not read and whose layout would cost more
    # than the rest of its step.

    def execute(self, batch: ForwardBatch) -> list[int | None]:
        """The next token of each sequence whose ``samples[i]`` is set, None for the others."""
