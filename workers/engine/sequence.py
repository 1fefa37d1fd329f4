"""A sequence: one request's tokens, how to sample them, and where it stands: a pure value.

A sequence's tokens are its prompt followed by what it has generated. ``num_computed`` counts
the tokens whose K and V are in the cache (reused from the prefix cache, or computed by earlier
steps); the scheduler moves it forward, a preemption by recompute resets it to 0 and keeps the
tokens, so the sequence resumes exactly where it was once its tokens are computed again::

    tokens          p0 p1 p2 p3 p4 p5 | g0 g1
                    <-- prompt -----> | <- output
    num_computed    ---------- 7 ---------->|      one token (g1) still to compute: a decode

State moves WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING on a preemption.
``block_hashes`` is the hash chain of the sequence's full blocks of tokens (the block manager
extends it as blocks fill); tokens never change once appended, so neither do the hashes.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from workers.sampling import Sampling


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence ended; the gateway maps these to the API's ``stop_reason``."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP_TOKEN = "stop_token"  # one of the request's stop_token_ids
    MAX_TOKENS = "max_tokens"  # max_tokens generated, or the model's context is full
    ABORTED = "aborted"  # the caller went away
    TOO_LONG = "too_long"  # cannot fit the KV cache alone, or its prompt fills the context


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine. Times are readings of the engine's clock (seconds)."""

    rid: int
    prompt_ids: list[int]
    sampling: Sampling = Sampling()
    tier: int = 0  # 0 is served first
    tenant: str = ""  # salts the prefix cache: two tenants never share a block; has a share of its tier
    weight: float = 1.0  # its tenant's weight within its tier (workers.shares)
    tpot_target: float = 0.0  # seconds per output token its tier promises; 0: none (workers.engine.seats)
    arrival: float = 0.0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # tokens the prefix cache supplied at the first admission (billed as cached)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    preemptions: list[float] = dataclasses.field(default_factory=list)
    charged: int = 0  # output tokens its tenant's share has been charged for

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.rid}: expected at least one prompt token")
        if self.tier < 0:
            raise ValueError(f"sequence {self.rid} tier: expected >= 0, got {self.tier}")
        if not 0.0 <= self.tpot_target < math.inf:
            raise ValueError(f"sequence {self.rid} tpot_target: expected seconds >= 0, "
                             f"got {self.tpot_target}")
        if len(self.output_ids) >= self.sampling.max_tokens:
            raise ValueError(f"sequence {self.rid}: resumed with {len(self.output_ids)} output tokens, "
                             f"max_tokens {self.sampling.max_tokens} leaves none to make")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of the prompt followed by the output, without joining the two
        lists (a prompt may be 50,000 long)."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next one can be sampled (1 for a decode)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed  # num_tokens, inlined: hot

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
