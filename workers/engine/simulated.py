"""A runner with no model: tokens from a seeded hash, the step's time from the cost model. Pure.

The engine cannot tell it from the torch runner: same :class:`~workers.engine.batch.Runner`
protocol, same cache geometry, a token for every sequence whose chunk ends at its last token. Each
token is a hash of the runner's seed, the request's seed, the output index and the last token
and position of the sequence's chunk, so a sequence's answer depends on nothing else in its
batch and comes out the same after a preemption and recompute (like greedy decoding, two
sequences with the same tokens continue alike). It never draws an end-of-sequence token unless
``eos_prob`` asks for them, from the same hash.

Each step's price, :attr:`SimulatedRunner.last_step_seconds`, is what the cost model says that
batch would take: a trio task replays traffic in virtual time with
``await trio.sleep(runner.last_step_seconds)``; a worker process passes ``wait=time.sleep`` to
behave like the GPU in real time.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable

from workers.engine.batch import BatchRunner, ForwardBatch
from workers.engine.cost_model import CostModel
from workers.engine.scheduler import Schedule

_KEY = struct.Struct(">5Q")


class SimulatedRunner(BatchRunner):
    """Prices each step (see the module doc); it reads a step's schedule rather than lay out its
    batch, whose positions, slots and block tables it has no use for."""

    def __init__(
        self,
        cost: CostModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_gb: float | None = None,
        eos_token_id: int = 2,
        eos_prob: float = 0.0,
        seed: int = 0,
        max_model_len: int = 131_072,
        wait: Callable[[float], object] | None = None,
        vocab: int | None = None,
    ) -> None:
        """Size the cache by ``num_blocks``, or by ``kv_memory_gb`` GiB of the model's KV (1024
        blocks when neither is given). Token ids are drawn from the model's vocabulary, or from
        the first ``vocab`` ids (128: ASCII, one character a token under the gateway's ``bytes`` tokenizer).
        ``max_model_len`` is the context it claims (Llama 3's)."""
        if num_blocks is not None and kv_memory_gb is not None:
            raise ValueError("SimulatedRunner: give num_blocks or kv_memory_gb, not both")
        if kv_memory_gb is not None:
            num_blocks = int(kv_memory_gb * 2**30) // (cost.shape.kv_bytes_per_token * block_size)
        if vocab is not None and vocab < 2:
            raise ValueError(f"SimulatedRunner vocab: expected at least 2 ids, got {vocab}")
        if not 0.0 <= eos_prob <= 1.0:
            raise ValueError(f"SimulatedRunner eos_prob: expected a probability in [0, 1], got {eos_prob}")
        self.cost, self.block_size, self.num_blocks = (
            cost,
            block_size,
            1024 if num_blocks is None else num_blocks,
        )
        self.eos_token_ids = frozenset({eos_token_id})
        self.max_model_len = max_model_len
        self._eos, self.eos_prob, self._seed64, self._wait = eos_token_id, eos_prob, seed % 2**64, wait
        self._vocab = cost.shape.vocab if vocab is None else vocab
        self._eos_below = math.ceil(eos_prob * 2**64)  # a digest's first 8 bytes below this: eos
        self.last_step_seconds = 0.0
        self.total_seconds = 0.0

    def execute(self, batch: ForwardBatch) -> list[int | None]:
        tokens: list[int | None] = []
        end = 0
        lens = zip(batch.query_lens, batch.context_lens, batch.samples, strict=True)
        for query_len, context_len, sample in lens:
            end += query_len
            if sample is None:
                tokens.append(None)
                continue
            # the chunk's last token sits at position context_len - 1 (the batch's contract)
            last = batch.input_ids[end - 1]
            tokens.append(self.token(sample.params.seed, sample.index, last, context_len - 1))
        self._price(batch.query_lens, batch.context_lens)
        return tokens

    def run(self, schedule: Schedule) -> list[int | None]:
        """What :meth:`execute` returns for the batch of ``schedule``, read from its sequences
        without laying the batch out (a pure decode's price from its run's context)."""
        if schedule.run is not None:
            draw, seqs = self.token, schedule.run.seqs
            self._charge(self.cost.decode_seconds(len(seqs), schedule.run.context))
            return [draw(s.sampling.seed, len(s.output_ids), s.output_ids[-1], s.num_computed) for s in seqs]
        tokens: list[int | None] = []
        context_lens = []
        for seq, n in zip(schedule.seqs, schedule.num_tokens, strict=True):
            end = seq.num_computed + n
            context_lens.append(end)
            outputs = seq.output_ids
            if end < len(seq.prompt_ids) + len(outputs):  # a prompt chunk short of its last token
                tokens.append(None)
                continue
            last = outputs[-1] if outputs else seq.prompt_ids[-1]  # the sequence's last token, at end - 1
            tokens.append(self.token(seq.sampling.seed, len(outputs), last, end - 1))
        self._price(schedule.num_tokens, context_lens)
        return tokens

    def _price(self, query_lens: list[int], context_lens: list[int]) -> None:
        self._charge(self.cost.step(query_lens, context_lens).seconds)

    def _charge(self, seconds: float) -> None:
        self.last_step_seconds = seconds
        self.total_seconds += seconds
        if self._wait is not None:
            self._wait(self.last_step_seconds)

    def token(self, seed: int | None, index: int, last: int, position: int) -> int:
        """The token a step samples for a sequence of sampling ``seed`` whose chunk ends with
        ``last`` at ``position``, as its ``index``-th output."""
        key = _KEY.pack(self._seed64, (seed or 0) % 2**64, index, last, position)
        digest = hashlib.blake2b(key, digest_size=16).digest()
        if self._eos_below and int.from_bytes(digest[:8]) < self._eos_below:
            return self._eos
        token = int.from_bytes(digest[8:]) % (self._vocab - 1)
        return token + (token >= self._eos)  # every id but the end-of-sequence one
