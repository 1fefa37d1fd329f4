"""A runner with a real paged KV cache and a toy model: the engine's slot arithmetic under test.

Its cache is one entry per slot, ``(position, token)``, written through the batch's
``slot_mapping``. Its "model" reads a sequence's whole context back through the sequence's block
table (``context_lens[i]`` tokens) and picks the next token from a hash of it. A wrong slot, a
block still holding another sequence's KV, or a position carried over from a previous sequence
(continuous batching's classic bug) reads a wrong context and fails loudly or changes the answer, which
:func:`reference` computes by plain full recompute, with no cache at all.
"""

from __future__ import annotations

from workers.engine.batch import BatchRunner, ForwardBatch
from workers.engine.sequence import FinishReason
from workers.sampling import Sampling

VOCAB = 40
EOS = 0


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


def reference(
    prompt: list[int], sampling: Sampling, eos: int | None = EOS
) -> tuple[list[int], FinishReason]:
    """The answer and why it stops, by recomputing from the whole context at every token."""
    output: list[int] = []
    while True:
        token = next_token(prompt + output)
        output.append(token)
        if token == eos and not sampling.ignore_eos:
            return output, FinishReason.EOS
        if token in sampling.stop_token_ids:
            return output, FinishReason.STOP_TOKEN
        if len(output) == sampling.max_tokens:
            return output, FinishReason.MAX_TOKENS


class PagedRunner(BatchRunner):
    def __init__(self, block_size: int, num_blocks: int, eos: int | None = EOS) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.eos_token_ids = frozenset() if eos is None else frozenset({eos})
        self.max_model_len = 1 << 30  # no context limit: the cache is the only one
        self.kv: list[tuple[int, int] | None] = [None] * (block_size * num_blocks)
        self.batches: list[ForwardBatch] = []

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, batch: ForwardBatch) -> list[int | None]:
        self.batches.append(batch)
        for slot, position, token in zip(batch.slot_mapping, batch.positions, batch.input_ids, strict=True):
            self.kv[slot] = (position, token)
        tokens: list[int | None] = []
        for table, context_len, sample in zip(
            batch.block_tables, batch.context_lens, batch.samples, strict=True
        ):
            if sample is None:
                tokens.append(None)
                continue
            context = []
            for position in range(context_len):
                entry = self.kv[self.slot(table, position)]
                assert entry is not None and entry[0] == position, f"position {position} reads {entry}"
                context.append(entry[1])
            tokens.append(next_token(context))
        return tokens
