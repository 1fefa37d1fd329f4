"""Does weight-only int4 pay on this CPU? A lone decode's matmuls in bfloat16, int8 and int4.

    python -m experiments.lowbit_matmul [--threads 2] [--rounds 5] [--passes 10]

A lone decode multiplies one row by every layer's four matrices (QKV, O, gate-up, down), each
read once from memory: it is bound by the bytes of the weights. This takes SmolLM2-135M's real
matrices (30 layers, 270 MB in bfloat16) and times one row through all of them, in layer
order so that no matrix is still in the caches when it is read again, with each kind of weight:
bfloat16 prepacked for oneDNN (what the engine runs), int8 with a scale per output row
(``torch._weight_int8pack_mm``, the engine's ``weights = "int8"``), and int4 with a scale and a
zero per group of input columns (``torch._weight_int4pack_mm_for_cpu``, groups of 32 and 64).
Each round times ``--passes`` passes of each kind in turn; reported: ms a pass, min / median over
rounds x passes, and the output's error against bfloat16's, relative (the norm of the
difference over the norm), over the same rows: the weights' rounding as one multiply sees it
(experiments/docs/engine-int8.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from experiments.common import markdown
from workers.convert import ensure_converted
from workers.engine.cpu.int8_linear import quantize
from workers.engine.cpu.packed_linear import PackedLinear
from workers.engine.model import LAYER_LINEARS, load_llama

Multiply = Callable[[torch.Tensor], torch.Tensor]


def int4(weight: torch.Tensor, group: int) -> Multiply:
    """``x @ weight.T`` with ``weight`` in 4 bits: per group of ``group`` input columns, 16 levels
    from its minimum to its maximum (a scale and a zero, bfloat16), as torch's CPU kernel takes them."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    levels = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.view(rows, cols), 1)
    scales_zeros = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def int8(weight: torch.Tensor) -> Multiply:
    qweight, scales = quantize(weight)
    return lambda x: torch._weight_int8pack_mm(x, qweight, scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Loaded in float32, where nothing is prepacked, then each matrix cast as the engine casts it.
    model = load_llama(ensure_converted("smollm2-135m"), torch.float32, torch.device("cpu"), kernels=False)
    matrices = [getattr(layer, name).weight.detach().to(torch.bfloat16).contiguous()
                for layer in model.layers for name in LAYER_LINEARS]
    del model
    kinds: dict[str, list[Multiply]] = {"bf16 (engine)": [PackedLinear(m) for m in matrices],
                                        "int8": [int8(m) for m in matrices]}
    for group in (32, 64):  # 576 input columns: 128 does not divide them
        kinds[f"int4, groups of {group}"] = [int4(m, group) for m in matrices]
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, m.shape[1], generator=generator).to(torch.bfloat16) for m in matrices]
    exact = [f(x).float() for f, x in zip(kinds["bf16 (engine)"], rows, strict=True)]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for kind, multiplies in kinds.items():
                for _ in range(args.passes):
                    started = time.perf_counter()
                    for multiply, x in zip(multiplies, rows, strict=True):
                        multiply(x)
                    times[kind].append(time.perf_counter() - started)
    table: list[dict[str, str]] = []
    for kind, multiplies in kinds.items():
        out = [f(x).float() for f, x in zip(multiplies, rows, strict=True)]
        error = statistics.mean(float((o - e).norm() / e.norm()) for o, e in zip(out, exact, strict=True))
        median = statistics.median(times[kind])
        spread = f"{min(times[kind]) * 1e3:.2f} / {median * 1e3:.2f}"
        table.append({"weights": kind, "ms a pass, min / median": spread,
                      "median / bf16": f"{median / statistics.median(times['bf16 (engine)']):.2f}",
                      "relative error": f"{error:.4f}"})
    print(markdown(table))


if __name__ == "__main__":
    main()
