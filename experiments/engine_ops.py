"""The engine's costliest operators against their alternatives, side by side on SmolLM2-135M's
shapes (bfloat16, one thread).

    python -m experiments.engine_ops [--rounds 15] [--seqs 32] [--context 272]

Each pair (or trio) runs alternately, ``--rounds`` times ``--calls`` calls each; reported per
operator: this thread's CPU microseconds a call, min and median. The shapes are one layer's of
a decode step of ``--seqs`` sequences with ``--context``-token contexts:

- **decode attention**: two matmuls with a float32 softmax (what the engine ran before) against
  ``scaled_dot_product_attention``, query ``[seqs, 3 KV heads, 3 query heads, 64]``;
- **greedy argmax** over ``[seqs, 49,152]`` float32 logits: torch's against numpy's;
- **RMSNorm** of ``[seqs, 576]``: transformers' sequence of ops against torch's fused ``rms_norm``;
- **gate_up_proj** (``576 -> 3,072``) at 1 and ``--seqs`` rows: bfloat16 ``linear`` against
  weight-only int8 (``torch._weight_int8pack_mm``, per-channel scales).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from experiments.common import markdown

BF16 = torch.bfloat16


def side_by_side(operators: dict[str, Callable[[], object]], rounds: int, calls: int) -> list[dict]:
    seconds: dict[str, list[float]] = {name: [] for name in operators}
    for _ in range(rounds):
        for name, operator in operators.items():
            started = time.thread_time()
            for _ in range(calls):
                operator()
            seconds[name].append((time.thread_time() - started) / calls)
    return [
        {"operator": name, "CPU us min": 1e6 * min(s), "CPU us median": 1e6 * statistics.median(s)}
        for name, s in seconds.items()
    ]


def attention(seqs: int, context: int) -> dict[str, Callable[[], object]]:
    q = torch.randn(seqs, 3, 3, 64, dtype=BF16)
    k, v = (torch.randn(seqs, 3, context, 64, dtype=BF16) for _ in "kv")
    mask = torch.zeros(seqs, 1, 1, context, dtype=BF16)
    mask[..., context - 8 :] = float("-inf")  # padding past the shortest context

    def matmuls() -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(0.125).add_(mask)
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(BF16), v)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)

    return {"attention: two matmuls": matmuls, "attention: sdpa": sdpa}


def argmax(seqs: int) -> dict[str, Callable[[], object]]:
    logits = torch.randn(seqs, 49_152)
    return {
        "argmax: torch": lambda: logits.argmax(dim=-1),
        "argmax: numpy": lambda: logits.numpy().argmax(axis=-1),
    }


def rms_norm(seqs: int) -> dict[str, Callable[[], object]]:
    x, weight = torch.randn(seqs, 576, dtype=BF16), torch.randn(576, dtype=BF16)

    def unfused() -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    return {"RMSNorm: unfused": unfused, "RMSNorm: rms_norm": lambda: F.rms_norm(x, (576,), weight, 1e-5)}


def int8_linear(rows: int) -> dict[str, Callable[[], object]]:
    x, weight = torch.randn(rows, 576, dtype=BF16), torch.randn(3072, 576, dtype=BF16)
    scales = weight.float().abs().amax(dim=1) / 127
    quantized = (weight.float() / scales[:, None]).round().to(torch.int8)
    bf16_scales = scales.to(BF16)
    return {
        f"gate_up {rows} rows: bfloat16": lambda: F.linear(x, weight),
        f"gate_up {rows} rows: int8 weights": lambda: torch._weight_int8pack_mm(x, quantized, bf16_scales),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=272)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict] = []
    for operators in (
        attention(args.seqs, args.context),
        argmax(args.seqs),
        rms_norm(args.seqs),
        int8_linear(1),
        int8_linear(args.seqs),
    ):
        rows += side_by_side(operators, args.rounds, args.calls)
    print(markdown(rows))


if __name__ == "__main__":
    main()
