"""What vLLM's next step should compute, as its adapter can tell before the step runs. Pure.

vLLM schedules inside its own ``step()``: which sequences it prefills, and how far, is decided
there. But the pool kills an engine silent for ``stats_timeout_ms``, so the adapter must announce
a long step before it starts (``workers/engine/step_forecast.py``), from what it remembers of each
sequence (:class:`Live`). Its figure errs on the long side:

- a sequence that has shown a token decodes one token;
- one that has not is taken to have its whole prompt still to prefill (its cached prefix is not
  known until vLLM's first output for it, and how much of a chunked prefill earlier steps did is
  not reported), in arrival order, vLLM's own;
- the step computes at most vLLM's per-step token budget (``max_num_batched_tokens``), the decodes
  first as vLLM schedules its running sequences first, so a long prompt's chunked prefill is
  priced one budget a step rather than at its whole length.

What this misses: a sequence vLLM preempted (and recomputes) is still counted as one decode
token; only a step under KV pressure does that, and the budget bounds it. Cost: one pass over the
live sequences a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from workers.protocol import Usage


@dataclasses.dataclass(slots=True)
class Live:
    """What the adapter remembers of one sequence vLLM holds."""

    prompt_tokens: int
    stop_ids: frozenset[int]  # EOS and the request's stop ids: not text, never sent
    shown: int = 0  # output ids reported so far
    cached: int = 0  # prompt tokens the prefix cache supplied, once vLLM says

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached, self.shown)


def step_lengths(sequences: Iterable[Live], budget: int) -> tuple[list[int], list[int]]:
    """The next step's ``(query_lens, context_lens)`` for a
    :class:`~workers.engine.interface.StepWatch`: the tokens it should compute of each sequence it
    should touch (in the order given: arrival), and what each then holds (see the module doc).
    ``budget``: vLLM's ``max_num_batched_tokens``, >= 1."""
    if budget < 1:
        raise ValueError(f"budget: expected >= 1, got {budget}")
    queries: list[int] = []
    contexts: list[int] = []
    new: list[Live] = []
    for seq in sequences:
        if not seq.shown:
            new.append(seq)
        elif len(queries) < budget:  # a decode: its last shown token in, the next out
            queries.append(1)
            contexts.append(seq.prompt_tokens + seq.shown)
    left = budget - len(queries)
    for seq in new:
        if left == 0:
            break
        chunk = min(seq.prompt_tokens, left)
        queries.append(chunk)
        contexts.append(chunk)
        left -= chunk
    return queries, contexts
