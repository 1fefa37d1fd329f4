"""A Hugging Face model directory as the engine reads it: shape, RoPE, stop tokens, weights.

What ``transformers`` writes for a Llama-family model, read by ``safetensors`` and
``tokenizers`` alone (no transformers at run time)::

    config.json                 the network's shape, RoPE (``rope_parameters``, or the older
                                ``rope_theta`` and ``rope_scaling``) and ``eos_token_id``
    generation_config.json      more ``eos_token_id`` (optional)
    tokenizer.json              the tokenizer, special tokens included
    tokenizer_config.json       the chat template (optional; :mod:`gateway.text.model_template` reads it)
    *.safetensors               the weights, named as transformers names them
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, slots=True)
class Rope:
    """Rotary embedding parameters; ``inv_freq`` gives the frequencies they imply."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """One frequency per pair of dimensions, float32, computed as transformers does.

        ``linear`` divides every frequency by ``factor``; ``llama3`` divides only the low ones
        (wavelength above ``original_max_position / low_freq_factor``) and blends smoothly up to
        ``original_max_position / high_freq_factor``, where frequencies stay as they are.
        """
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            blended = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, blended, scaled)
        return inv_freq


def read_rope(config: dict) -> Rope:
    """The RoPE a ``config.json`` describes; a ValueError names a type this engine lacks."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope type: expected one of {ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "default":
        return Rope(theta=float(theta))
    if rope_type == "linear":
        return Rope(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    return Rope(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position=int(
            params.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
        ),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shape of a Llama-family network, read from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, config: dict) -> LlamaConfig:
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        if config.get("model_type", "llama") != "llama" or architectures != ["LlamaForCausalLM"]:
            raise ValueError(
                f"config.json: expected a llama model (LlamaForCausalLM), got model_type "
                f"{config.get('model_type')!r}, architectures {architectures!r}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ValueError(f"config.json {flag}: biases are not supported, got {config[flag]!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act: expected 'silu', got {config['hidden_act']!r}")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"config.json num_key_value_heads: expected a divisor of {heads} heads, got {kv_heads}"
            )
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=read_rope(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token holds across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_size


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def read_config(model_dir: Path) -> LlamaConfig:
    return LlamaConfig.from_dict(_read_json(model_dir / "config.json"))


def read_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids of ``config.json`` and ``generation_config.json`` together (an instruct model's
    generation config often adds its end-of-turn token)."""
    return frozenset(
        _ids(_read_json(model_dir / "config.json").get("eos_token_id"))
        | _ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    )


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file of the directory, on the CPU."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors
