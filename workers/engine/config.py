"""The engine's settings and their defaults, the one source of them: the shape of the KV cache
and what one step may hold (:class:`EngineConfig`), the weights' precision and the CPU threads of
a step. A model table, an engine's command line and the simulator all default to these. Pure."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine pages its KV cache and fills each step.

    ``block_size`` and ``num_blocks`` must be the runner's own (the runner owns the memory);
    ``max_batch_tokens`` is the one token budget of every step, prompt chunks and decodes alike;
    ``max_seqs`` caps the running sequences, so every running decode fits one step's budget;
    ``watermark`` is the fraction of blocks an admission leaves free, room for the running
    sequences to grow without preempting the one just admitted; ``model_version`` salts the
    prefix cache, so blocks computed by other weights never match.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_batch_tokens: int = 512
    max_seqs: int = 256
    watermark: float = 0.01
    model_version: str = ""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_batch_tokens", "max_seqs"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"EngineConfig.{name}: expected an integer >= 1, got {value!r}")
        if self.max_seqs > self.max_batch_tokens:
            raise ValueError(
                f"EngineConfig.max_seqs: expected <= max_batch_tokens ({self.max_batch_tokens}) so that "
                f"every running decode fits one step, got {self.max_seqs}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"EngineConfig.watermark: expected a fraction in [0, 1), got {self.watermark!r}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


DEFAULTS = EngineConfig()
"""The engine's settings where nothing else is said."""
DTYPES = ("float32", "bfloat16")
"""The precisions the engine computes in (its weights and KV cache)."""
DTYPE = "float32"
"""The default precision: exact against the float32 reference on any CPU."""
WEIGHTS = ("bf16", "int8", "int4")
"""How a bfloat16 engine on a CPU holds its layers' matrices: bfloat16 alone, or also in int8 or
int4 for steps of few rows (workers/engine/cpu/int8_linear.py, int4_linear.py); the first is the
default."""
THREADS = 1
"""torch's CPU threads a step uses by default: one never spins on a core the gateway needs."""
