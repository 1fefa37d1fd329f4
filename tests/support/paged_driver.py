"""A stand-in for the engine's scheduler and block manager, just enough to feed a ModelRunner the
batches a continuous engine would (the real ones are tested on their own):

- requests arrive at different steps and join the running batch;
- prompts are prefilled in uneven random chunks, in the same batches as other sequences'
  decodes, each sequence at a shuffled place in its batch;
- blocks are handed out last-freed-first, so a new sequence lands in the blocks another just
  left, in reverse order (non-contiguous tables, stale K and V in them);
- the cache starts as noise, so any read outside a sequence's own context would show.

A request is admitted only when blocks for its whole answer are free: no preemption here.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from workers.engine.batch import ForwardBatch, Sample
from workers.engine.runner import ModelRunner
from workers.sampling import Sampling


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: int = 0  # the step it arrives at
    params: Sampling = dataclasses.field(default_factory=Sampling)


@dataclasses.dataclass
class _Running:
    rid: int
    request: Request
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[len(self.request.prompt) :]


class PagedDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0, max_chunk: int = 7) -> None:
        self.runner = runner
        self.rng = random.Random(seed)
        self.max_chunk = max_chunk
        self.free = list(range(runner.num_blocks))[::-1]  # pop() hands out block 0 first
        self.reserved = 0
        self.used: set[int] = set()
        self.tables: dict[int, list[int]] = {}  # each finished sequence's block table
        self.mixed_steps = 0  # batches holding both decodes and prefill chunks
        self.reused_blocks = 0  # blocks handed out again after a sequence freed them
        torch.manual_seed(seed)
        runner.kv_cache.normal_(0.0, 3.0)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.runner.block_size)

    def run(self, requests: list[Request]) -> list[list[int]]:
        """Each request's output tokens, in request order."""
        waiting = list(enumerate(requests))
        running: list[_Running] = []
        done: dict[int, list[int]] = {}
        step = 0
        while waiting or running:
            while waiting and waiting[0][1].arrival <= step:
                rid, request = waiting[0]
                need = self._blocks_for(len(request.prompt) + request.max_tokens)
                if need > len(self.free) - self.reserved:
                    break
                waiting.pop(0)
                self.reserved += need
                running.append(_Running(rid, request, list(request.prompt)))
            step += 1
            if running:
                self._step(running)
            for seq in [s for s in running if len(s.outputs) == s.request.max_tokens]:
                running.remove(seq)
                done[seq.rid] = seq.outputs
                self.tables[seq.rid] = seq.blocks
                self.reserved -= self._blocks_for(len(seq.request.prompt) + seq.request.max_tokens) - len(
                    seq.blocks
                )
                self.free.extend(seq.blocks)
        return [done[rid] for rid in range(len(requests))]

    def _step(self, running: list[_Running]) -> None:
        order = self.rng.sample(running, len(running))
        ids, positions, slots, query_lens, context_lens, tables, samples, chunks = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        bs = self.runner.block_size
        for seq in order:
            remaining = len(seq.tokens) - seq.computed
            chunk = 1 if remaining == 1 else self.rng.randint(1, min(remaining, self.max_chunk))
            end = seq.computed + chunk
            while len(seq.blocks) < self._blocks_for(end):
                block = self.free.pop()
                self.reused_blocks += block in self.used
                self.used.add(block)
                self.reserved -= 1
                seq.blocks.append(block)
            span = range(seq.computed, end)
            ids.extend(seq.tokens[p] for p in span)
            positions.extend(span)
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in span)
            query_lens.append(chunk)
            context_lens.append(end)
            tables.append(list(seq.blocks))
            last = end == len(seq.tokens)
            samples.append(Sample(seq.request.params, len(seq.outputs)) if last else None)
            chunks.append(chunk)
        self.mixed_steps += 1 in chunks and any(c > 1 for c in chunks)
        batch = ForwardBatch(ids, positions, slots, query_lens, context_lens, tables, samples)
        for seq, chunk, token in zip(order, chunks, self.runner.execute(batch), strict=False):
            seq.computed += chunk
            if token is not None:
                seq.tokens.append(token)
