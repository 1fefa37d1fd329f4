"""Static batching the plain way, over the engine's network: one padded batch that waits for its
longest answer.

One of the baselines the continuous engine is measured against (``experiments/engine_bench.py``),
the way a server without paging batches: a contiguous cache and padding. (The fixed-mode
``generate`` worker, :class:`workers.models.Generate`, batches statically over the engine's own
paged runner instead: no padding in its prefill.) A batch of prompts is padded on
the left to its longest, prefilled in one forward pass, then decoded one token per row per step
until every row has ended (EOS or its own ``max_tokens``). A row that ended is still computed:
the batch keeps its shape, so its step costs what the full batch costs. The KV cache is
contiguous, reserved up front for the longest prompt plus the longest answer, for every row::

    row 0   .   .   p0  p1  p2  p3 | g0  g1  g2  EOS  x   x     <- ended; still computed (x)
    row 1   p0  p1  p2  p3  p4  p5 | g0  g1  g2  g3   g4  g5
            <- prompts, left padded -> <- as many steps as the longest answer ->

Left padding puts every row's last prompt token in the same column, so each step appends one
column to all rows. The mask hides pad keys, and RoPE positions count each row's own tokens
(pads sit at position 0), so a row answers exactly as it would alone. Greedy only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from workers.engine.checkpoint import read_eos_token_ids
from workers.engine.model import Projection, load_llama, placement


class PaddedAttention:
    """The model's :class:`~workers.engine.model.Attention` over a contiguous cache
    ``[layers, 2, rows, kv_heads, length, head_dim]``: one forward pass's ``rows x width`` tokens
    (row-major in the flat batch) go to columns ``start .. start + width - 1``, and each attends to
    the columns ``mask`` ([rows, 1, width * group or 1, start + width], additive) leaves open."""

    def __init__(self, cache: torch.Tensor, mask: torch.Tensor, start: int, rows: int, width: int) -> None:
        self.cache, self.mask, self.start, self.rows, self.width = cache, mask, start, rows, width

    def __call__(self, layer: int, projection: Projection, scale: float) -> torch.Tensor:
        q, k, v = projection.rotated()
        rows, width, end = self.rows, self.width, self.start + self.width
        _, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        cache = self.cache[layer]
        cache[0, :, :, self.start : end] = k.view(rows, width, kv_heads, head_dim).transpose(1, 2)
        cache[1, :, :, self.start : end] = v.view(rows, width, kv_heads, head_dim).transpose(1, 2)
        # A KV head's `group` query heads become rows of one query matrix: no copy of K and V.
        # (scaled_dot_product_attention reads the cache's strided columns in place; two matmuls
        # would copy them first: 20 % slower a bfloat16 decode step, 16 rows of 500 tokens.)
        query = (
            q.view(rows, width, kv_heads, group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(rows, kv_heads, width * group, head_dim)
        )
        out = F.scaled_dot_product_attention(
            query, cache[0, :, :, :end], cache[1, :, :, :end], attn_mask=self.mask, scale=scale
        )
        return (
            out.view(rows, kv_heads, width, group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(rows * width, heads * head_dim)
        )


class StaticBatcher:
    """Loads ``model_dir`` and answers whole batches of token prompts, greedily, one padded
    batch at a time (see the module's docstring)."""

    def __init__(
        self, model_dir: str | Path, *, dtype: str = "float32", device: str | torch.device | None = None
    ) -> None:
        self.dtype, self.device = placement(dtype, device)
        model_dir = Path(model_dir)
        self.model = load_llama(model_dir, self.dtype, self.device)
        self.config = self.model.config
        self.eos_token_ids = read_eos_token_ids(model_dir)
        self.max_model_len = self.config.max_position_embeddings

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool = False
    ) -> list[list[int]]:
        """Each prompt's answer: up to its ``max_tokens``, ending at its first EOS unless
        ``ignore_eos``. The batch runs until its longest answer is done."""
        if not prompts or len(max_tokens) != len(prompts):
            raise ValueError(f"max_tokens: expected one per prompt ({len(prompts)}), got {len(max_tokens)}")
        for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=False)):
            if not prompt or limit < 1 or len(prompt) + limit > self.max_model_len:
                raise ValueError(
                    f"prompts[{i}]: expected 1 or more tokens and max_tokens >= 1 within the model's "
                    f"context of {self.max_model_len}, got {len(prompt)} tokens and max_tokens {limit}"
                )
        c, device = self.config, self.device
        rows, width, steps = len(prompts), max(map(len, prompts)), max(max_tokens)
        length = width + steps - 1  # the last token sampled is never computed
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        column = torch.arange(length, device=device)
        real = column[None, :] >= (width - lengths)[:, None]  # [rows, length]: not a pad
        positions = (column[None, :width] - (width - lengths)[:, None]).clamp_min(0)
        self.model.rotary.ensure(length)
        cache = torch.zeros(
            (c.num_layers, 2, rows, c.num_kv_heads, length, c.head_dim), dtype=self.dtype, device=device
        )
        # Prefill: a column sees the columns up to its own that hold tokens (a pad sees itself:
        # a row of nothing but -inf would give NaN).
        causal = column[:width, None] >= column[None, :width]
        see = causal & (real[:, None, :width] | torch.eye(width, dtype=torch.bool, device=device))
        mask = self._additive(see).repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
        attention = PaddedAttention(cache, mask.unsqueeze(1), 0, rows, width)
        hidden = self.model(ids.view(-1), positions.reshape(-1), attention).view(rows, width, -1)[:, -1]
        answers: list[list[int]] = [[] for _ in prompts]
        done = [False] * rows
        for step in range(steps):
            tokens = self.model.logits(hidden).argmax(dim=-1)
            for row, token in enumerate(tokens.tolist()):
                if not done[row]:
                    answers[row].append(token)
                    done[row] = len(answers[row]) == max_tokens[row] or (
                        token in self.eos_token_ids and not ignore_eos
                    )
            if all(done):
                break
            at = width + step  # every row's next token goes to this column, ended rows' too
            mask = self._additive(real[:, None, None, : at + 1])
            attention = PaddedAttention(cache, mask, at, rows, 1)
            hidden = self.model(tokens, lengths + step, attention)
        return answers

    def _additive(self, see: torch.Tensor) -> torch.Tensor:
        """0 where ``see`` holds, -inf elsewhere, in the model's dtype (what attention adds)."""
        return torch.zeros(see.shape, dtype=self.dtype, device=self.device).masked_fill_(~see, float("-inf"))
