"""The test oracles: transformers' greedy ``generate`` (with its own logits processors for a
request's ``logit_bias`` and penalties), and a plain Llama forward with no cache.

The naive forward reads the checkpoint's tensors as they are (separate Q, K, V, gate and up matrices), expands
the KV heads, and recomputes the whole sequence for every token it generates, with
``is_causal`` attention: nothing paged, nothing batched, nothing reused. What it shares with the
engine is only ``checkpoint.py`` (the config and RoPE frequencies, which the transformers
oracle checks independently).
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
import torch.nn.functional as F

from workers.engine.checkpoint import read_config, read_tensors
from workers.sampling import Sampling


class NaiveLlama:
    def __init__(self, model_dir: Path) -> None:
        self.config = read_config(model_dir)
        self.w = read_tensors(model_dir)
        if self.config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.inv_freq = self.config.rope.inv_freq(self.config.head_dim)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Float32 logits [len(tokens), vocab] of the whole sequence, computed from scratch."""
        c, w = self.config, self.w
        n = len(tokens)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos()[None], angles.sin()[None]  # [1, n, head_dim]
        h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            x = self._norm(h, p + "input_layernorm.weight")
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, c.head_dim).transpose(0, 1)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            group = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, -1)
            h = h + a @ w[p + "self_attn.o_proj.weight"].T
            x = self._norm(h, p + "post_attention_layernorm.weight")
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(h, "model.norm.weight") @ w["lm_head.weight"].T

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(int(self.logits(tokens)[-1].argmax()))
        return tokens[len(prompt) :]


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int], samplings: list[Sampling] | None = None
) -> list[list[int]]:
    """transformers' ``LlamaForCausalLM.generate``, greedy, float32, one prompt at a time (no
    padding), each run to its full length whatever EOS it meets. A sampling's ``logit_bias`` is
    transformers' ``sequence_bias`` of one-token sequences and its ``repetition_penalty`` its own;
    transformers has no OpenAI penalties, so :class:`OpenAIPenalties` adds them after those two."""
    from transformers import GenerationConfig, LlamaForCausalLM, LogitsProcessorList

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    answers = []
    for index, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=False)):
        s = samplings[index] if samplings else Sampling()
        bias = {(token,): value for token, value in s.logit_bias} or None
        config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                                  repetition_penalty=s.repetition_penalty, sequence_bias=bias)
        penalties = OpenAIPenalties(len(prompt), s.frequency_penalty, s.presence_penalty)
        processors = LogitsProcessorList([penalties])
        out = model.generate(torch.tensor([prompt]), generation_config=config, logits_processor=processors)
        answers.append(out[0, len(prompt) :].tolist())
    return answers


class OpenAIPenalties:
    """OpenAI's frequency and presence penalties over the generated tokens, as a transformers
    logits processor (written here from OpenAI's formula, independently of the engine's)."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            for token, count in collections.Counter(input_ids[row, self.prompt_length :].tolist()).items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores
