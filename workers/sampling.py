"""How a sequence picks its tokens and when it stops: the sampling parameters a request carries to an
engine, checked where they are made (the gateway's codecs build them, the ``add`` frame carries them,
the engine's sampler and scheduler read them)."""

from __future__ import annotations

import math

import msgspec


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a sequence picks its tokens and when it stops: the one type from a request to an engine.

    ``temperature`` 0 is greedy; None is the model's default, which the pool puts in its place
    (an engine given None samples greedily). ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch
    those filters off; a ``seed`` makes a sampled answer reproducible whatever else shares its
    batch. Before any of them, greedy or not, the logits are adjusted as vLLM and OpenAI do:
    ``logit_bias`` ((token id, bias) pairs) added, then ``repetition_penalty`` (1: off) on every
    token of the prompt and the output, ``frequency_penalty`` times each token's count in the
    output and ``presence_penalty`` once per token present there subtracted. It stops after
    ``max_tokens``, or at one of ``stop_token_ids`` or the model's end-of-sequence id (unless
    ``ignore_eos``). Fixed-mode models read none of it.
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {self.max_tokens}")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0: off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: expected a number in -2..2, got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty: expected a number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a number in 0..1, got {self.min_p}")
        if any(token < 0 or not -100.0 <= bias <= 100.0 for token, bias in self.logit_bias):
            raise ValueError("logit_bias: expected token ids >= 0 with biases in -100..100")

    @property
    def greedy(self) -> bool:
        return not self.temperature

    @property
    def penalized(self) -> bool:
        """A penalty reads the sequence's tokens (its output; the prompt too for repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """The logits are changed before any token is picked (greedy ones too)."""
        return self.penalized or bool(self.logit_bias)

    def replace(self, **changes: object) -> Sampling:
        """This sampling with ``changes`` (checked again)."""
        return msgspec.structs.replace(self, **changes)
