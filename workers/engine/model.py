"""A Llama-family network whose attention reads and writes the paged KV cache.

The math is transformers' ``LlamaForCausalLM`` (RMSNorm in float32, rotate-half RoPE,
grouped-query attention, SwiGLU, tied or untied embeddings), so in float32 its greedy tokens
match transformers' token for token; Q, K and V are one matmul, and so are the MLP's gate and
up (:func:`load_llama` fuses the checkpoint's matrices at load). One forward pass takes a whole
step, every sequence's tokens flattened into ``[tokens, hidden]``: only the attention knows where
one sequence ends and where its K and V live, and the network takes it as an argument
(:class:`Attention`, which applies RoPE too): the engine's paged cache, or the contiguous cache of
a padded static batch (:mod:`experiments.static_batch`), over the same weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.checkpoint import LlamaConfig, read_config, read_tensors
from workers.engine.config import WEIGHTS
from workers.engine.cpu import kernels as cpu_kernels
from workers.engine.cpu.int4_linear import Int4Linear
from workers.engine.cpu.int8_linear import Int8Linear
from workers.engine.cpu.packed_linear import PackedLinear, can_pack, pack_linears


class Rope:
    """RoPE of one forward pass: each token's position and the :class:`Rotary` tables they index
    (what a kernel reads), and each token's cos and sin in a dtype (what torch multiplies by),
    taken once per pass."""

    __slots__ = ("_per_token", "cos", "positions", "sin")

    def __init__(self, positions: torch.Tensor, rotary: Rotary) -> None:
        self.positions, self.cos, self.sin = positions, rotary.cos, rotary.sin
        self._per_token: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def per_token(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [tokens, 1, head_dim]."""
        if dtype not in self._per_token:
            cos, sin = self.cos[self.positions, None], self.sin[self.positions, None]
            self._per_token[dtype] = (cos.to(dtype), sin.to(dtype))
        return self._per_token[dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class Projection:
    """One layer's Q, K and V as projected, before RoPE: ``qkv`` [tokens, (heads + 2 * kv_heads) *
    head_dim], and what rotates them."""

    qkv: torch.Tensor
    rope: Rope
    heads: int
    kv_heads: int
    head_dim: int

    def rotated(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], q and k rotated."""
        heads, kv_heads = self.heads, self.kv_heads
        qkv = self.qkv.view(-1, heads + 2 * kv_heads, self.head_dim)
        cos, sin = self.rope.per_token(qkv.dtype)
        qk = rotate(qkv[:, : heads + kv_heads], cos, sin)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]


class Attention(Protocol):
    """One forward pass's attention, layer by layer: rotate Q and K, store K and V in layer
    ``layer``'s cache, then attend each query to what its token may see; returns [tokens, heads *
    head_dim]."""

    def __call__(self, layer: int, projection: Projection, scale: float) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in float32 whatever the model's dtype (bfloat16 sums of squares
    would drift, and torch's fused ``rms_norm`` rounds bfloat16 otherwise than transformers)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Elementwise(Protocol):
    """A decoder layer's small operators: torch's (:class:`TorchElementwise`), or ferry's CPU
    kernels fused each into one pass (:class:`workers.engine.cpu.kernels.Kernels`), the same
    arithmetic and roundings."""

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The RMSNorm of ``residual + x`` (of ``residual`` where ``x`` is None), times ``weight``,
        and that sum, the next residual (``residual`` may be written in place)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, gate and up the halves of each row of ``gate_up``."""
        ...


class TorchElementwise:
    """:class:`Elementwise` with torch's operators, as transformers computes it."""

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual if x is None else residual + x
        return rms_norm(h, weight, eps), h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Rotary:
    """cos/sin tables by position in float32, grown on demand past the checkpoint's context.

    The sin table's first half is negated, so that :func:`rotate` turns each head's halves with
    one ``roll`` instead of slicing, negating and joining them (the same numbers: a sign flip
    is exact)."""

    def __init__(self, config: LlamaConfig, device: torch.device) -> None:
        self.inv_freq = config.rope.inv_freq(config.head_dim).to(device)
        self.cos = self.sin = torch.empty(0, device=device)
        self.ensure(config.max_position_embeddings)

    def ensure(self, length: int) -> None:
        """Make the tables cover positions ``0 .. length - 1``."""
        if length <= self.cos.shape[0]:
            return
        positions = torch.arange(
            max(length, 2 * self.cos.shape[0]), dtype=torch.float32, device=self.inv_freq.device
        )
        angles = positions[:, None] * self.inv_freq[None, :]
        sin = angles.sin()
        self.cos, self.sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


TORCH_ELEMENTWISE = TorchElementwise()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, ``x * cos + cat(-x2, x1) * sin``, with ``sin`` from :class:`Rotary`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(
        self, x: torch.Tensor | None, residual: torch.Tensor, rope: Rope, attention: Attention, index: int,
        ops: Elementwise,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on ``residual + x`` (the last layer's output, None before the first): its MLP's
        output and its residual, whose sum is the layer's output. The sum is left to the next
        layer, whose norm takes it in the same pass (:meth:`Elementwise.add_rms_norm`)."""
        norm = self.input_layernorm
        normed, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        projection = Projection(self.qkv_proj(normed), rope, self.heads, self.kv_heads, self.head_dim)
        attended = self.o_proj(attention(index, projection, self.scale))
        norm = self.post_attention_layernorm
        normed, residual = ops.add_rms_norm(attended, residual, norm.weight, norm.eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(normed))), residual


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kernels: cpu_kernels.Kernels | None = None  # ferry's CPU kernels, where load_llama found them

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Hidden states [tokens, hidden] before the final norm; ``attention`` stores every
        layer's K and V."""
        residual = self.embed_tokens(input_ids)
        rope = Rope(positions, self.rotary)
        ops: Elementwise = self.kernels or TORCH_ELEMENTWISE
        x = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, attention, index, ops)
        return residual if x is None else residual + x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows asked for: only the tokens that are sampled pay for the
        vocabulary-sized matmul."""
        return self.lm_head(self.norm(hidden)).float()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def placement(dtype: str, device: str | torch.device | None) -> tuple[torch.dtype, torch.device]:
    """The torch dtype a name gives (a ValueError names any other), and the device: ``device``,
    or CUDA where present, else the CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype], torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LINEARS = {"bf16": PackedLinear, "int8": Int8Linear, "int4": Int4Linear}  # by the weights option


def load_llama(
    model_dir: Path, dtype: torch.dtype, device: torch.device, kernels: bool = True, weights: str = WEIGHTS[0]
) -> Llama:
    """The network of a Hugging Face directory, its weights fused and cast to ``dtype``; in
    bfloat16 on the CPU, each layer's matrices and the lm_head prepacked for oneDNN
    (:mod:`workers.engine.cpu.packed_linear`). ``kernels``:
    ferry's CPU kernels where they run here (else, or False, torch's operators). ``weights``
    ``"int8"`` or ``"int4"``: each layer's matrices also in that many bits, for steps of few rows
    (:mod:`workers.engine.cpu.int8_linear`, :mod:`~workers.engine.cpu.int4_linear`; bfloat16 on
    a CPU only)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {list(WEIGHTS)}, got {weights!r}")
    if weights != "bf16" and not can_pack(dtype, device):
        raise ValueError(f"weights: {weights!r} needs dtype bfloat16 on a CPU with oneDNN's bfloat16")
    config = read_config(model_dir)
    tensors = _fused_tensors(model_dir, config)
    cast = {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors.items()}
    if config.tie_word_embeddings:
        cast["lm_head.weight"] = cast["embed_tokens.weight"]
    rotary = Rotary(config, device)
    with torch.device("meta"):  # no memory for weights about to be replaced by the checkpoint's
        model = Llama(config, rotary)
    model.load_state_dict(cast, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if can_pack(dtype, device):  # a tied lm_head's packed copy is a second copy of the embedding
        for layer in model.layers:
            pack_linears(layer, LAYER_LINEARS, LINEARS[weights])
        pack_linears(model, ("lm_head",))
    model.kernels = cpu_kernels.usable(dtype, device) if kernels else None
    return model.eval()


def _fused_tensors(model_dir: Path, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by the model's names, Q, K and V and the MLP's gate and up
    fused; a tied lm_head is the embedding."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in read_tensors(model_dir).items():
        if not name.startswith("model.") and name != "lm_head.weight":
            raise ValueError(f"{model_dir}: unexpected tensor {name!r} for a Llama checkpoint")
        tensors[name.removeprefix("model.")] = tensor
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        attention = [tensors.pop(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]
        mlp = [tensors.pop(f"{prefix}mlp.{p}_proj.weight") for p in ("gate", "up")]
        tensors[prefix + "qkv_proj.weight"] = torch.cat(attention, dim=0)
        tensors[prefix + "gate_up_proj.weight"] = torch.cat(mlp, dim=0)
        tensors[prefix + "o_proj.weight"] = tensors.pop(prefix + "self_attn.o_proj.weight")
        tensors[prefix + "down_proj.weight"] = tensors.pop(prefix + "mlp.down_proj.weight")
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return tensors

