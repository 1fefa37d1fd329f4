"""The time of one engine step on a GPU, from the model's shape and the GPU's speeds. Pure.

A step reads every weight once whatever the batch (the read that batching shares), reads the KV
of every context token, and does 2 FLOPs per parameter per computed token, plus attention::

    memory  = (weights + KV bytes per token x sum(context_lens)) / bandwidth
    compute = (2 x params x sum(query_lens) + attention FLOPs) / FLOP/s
    step    = max(memory, compute)

A roofline, not a sum (a GPU streams memory while it multiplies), at upper-bound speeds. What it
leaves out is an :class:`Overhead` (per step, sequence, token, context token, attention pair),
zero in every preset; on a CPU it is most of a step, which ``ferry fit`` measures."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family decoder's dimensions; ``stated_params`` overrides the count the shape gives
    (capacity arithmetic usually reasons with a round 70B)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2
    bytes_per_kv: int = 2
    stated_params: int | None = None

    @property
    def params(self) -> int:
        if self.stated_params is not None:
            return self.stated_params
        attention = (
            self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        )
        layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden  # SwiGLU, two RMSNorms
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * layer + embeddings + self.hidden  # the final norm

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    """``gpus`` identical GPUs in tensor parallel: their bandwidth and FLOP/s add up."""

    name: str
    bandwidth: float  # bytes/s of one GPU's memory
    flops: float  # dense 16-bit FLOP/s of one GPU
    gpus: int = 1


UNBOUNDED = Hardware("no roofline", bandwidth=math.inf, flops=math.inf)
"""A roofline that costs nothing: a cost model over it is its :class:`Overhead` alone."""


@dataclasses.dataclass(frozen=True, slots=True)
class Overhead:
    """Seconds a step costs beyond its roofline, linear in what it holds: per step, per sequence,
    per computed (query) token, per context token of each sequence, per attention pair (a query
    token against one key of its sequence; a decode token has as many as its context)."""

    step: float = 0.0
    seq: float = 0.0
    token: float = 0.0
    context: float = 0.0
    pair: float = 0.0

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"overhead {name}: expected seconds >= 0, got {value}")

    def seconds(self, seqs: int, tokens: int, context_tokens: int, pairs: int) -> float:
        linear = self.seq * seqs + self.token * tokens + self.context * context_tokens
        return self.step + linear + self.pair * pairs


@dataclasses.dataclass(frozen=True, slots=True)
class StepCost:
    memory_seconds: float
    compute_seconds: float
    overhead_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds) + self.overhead_seconds


class CostModel:
    """Prices a step from its ``query_lens`` and ``context_lens`` (a ForwardBatch's own fields):
    the roofline of ``shape`` on ``hardware``, plus ``overhead``."""

    def __init__(self, shape: ModelShape, hardware: Hardware, overhead: Overhead = Overhead()) -> None:
        self.shape, self.hardware, self.overhead = shape, hardware, overhead
        self._free = overhead == Overhead()
        self._bandwidth = hardware.bandwidth * hardware.gpus
        self._flops = hardware.flops * hardware.gpus
        # the shape's products, once rather than at every step priced
        self._weight_bytes, self._kv_bytes = shape.weight_bytes, shape.kv_bytes_per_token
        self._token_flops = 2 * shape.params
        self._pair_flops = 4 * shape.layers * shape.heads * shape.head_dim

    def attention_flops(self, query_len: int, context_len: int) -> int:
        """A chunk of ``query_len`` tokens ending at ``context_len``: token ``p`` reads ``p + 1`` keys."""
        shape = self.shape
        return 4 * shape.layers * shape.heads * shape.head_dim * attention_pairs(query_len, context_len)

    def step(self, query_lens: list[int], context_lens: list[int]) -> StepCost:
        memory = self._weight_bytes + self._kv_bytes * sum(context_lens)
        compute = self._token_flops * sum(query_lens)
        # attention_pairs summed over the batch, inline (the replay prices millions of steps)
        pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens, strict=False))
        compute += self._pair_flops * pairs
        overhead = 0.0
        if not self._free:
            overhead = self.overhead.seconds(len(query_lens), sum(query_lens), sum(context_lens), pairs)
        return StepCost(memory / self._bandwidth, compute / self._flops, overhead)

    def decode_seconds(self, seqs: int, context_tokens: int) -> float:
        """``step([1] * seqs, context_lens).seconds`` for contexts summing to ``context_tokens``,
        the same float, without the lists (a decode token attends to its whole context)."""
        memory = self._weight_bytes + self._kv_bytes * context_tokens
        compute = self._token_flops * seqs + self._pair_flops * context_tokens
        roofline = max(memory / self._bandwidth, compute / self._flops)
        if self._free:
            return roofline
        return roofline + self.overhead.seconds(seqs, seqs, context_tokens, context_tokens)


def attention_pairs(query_len: int, context_len: int) -> int:
    """(query, key) pairs of a chunk of ``query_len`` tokens ending at ``context_len``."""
    return query_len * context_len - query_len * (query_len - 1) // 2


H100 = Hardware("H100 SXM", bandwidth=3.35e12, flops=989e12)
H200 = Hardware("H200 SXM", bandwidth=4.8e12, flops=989e12)
A100 = Hardware("A100 SXM 80GB", bandwidth=2.039e12, flops=312e12)

LLAMA_70B = ModelShape(
    "llama-70b",
    layers=80,
    hidden=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    ffn=28672,
    vocab=128256,
    stated_params=70_000_000_000,
)  # the shape of Llama 3 70B, priced as a round 70B, 16-bit

LLAMA_8B = ModelShape(
    "llama-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256
)  # Llama 3 8B: 8.03 B parameters, 128 KiB of KV a token

SMOLLM2_135M = ModelShape(
    "smollm2-135m",
    layers=30,
    hidden=576,
    heads=9,
    kv_heads=3,
    head_dim=64,
    ffn=1536,
    vocab=49152,
    tied_embeddings=True,
)

PRESETS: dict[str, CostModel] = {
    "llama-70b": CostModel(LLAMA_70B, dataclasses.replace(H100, gpus=8)),
    "smollm2-135m": CostModel(SMOLLM2_135M, H100),
}
"""Named (model, hardware) pairs: a round 70B on 8 x H100, and SmolLM2-135M on one H100."""
