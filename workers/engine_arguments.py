"""The command lines of the two engine kinds, ``engine`` (ferry's continuous engine,
workers/engine/serve.py) and ``vllm-engine`` (vLLM's, workers/vllm_engine.py), apart from the
engines themselves.

Every worker process parses its command line with these, whatever its kind; the engines are
imported only by a worker that runs one. A fixed-mode worker restarted after a crash is what a
fleet waits for while every one of its workers restarts at once, and importing an engine it
never runs (the scheduler, the model code, numpy) was two thirds of its start-up here.
"""

from __future__ import annotations

import argparse

from workers.engine.cost_model import PRESETS


def add_engine_arguments(kinds: argparse._SubParsersAction) -> None:
    engine = kinds.add_parser(
        "engine", help="the continuous LLM engine: paged KV cache, one token budget a step"
    )
    source = engine.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a Hugging Face model directory")
    source.add_argument(
        "--simulated",
        choices=sorted(PRESETS),
        help="no model: seeded tokens, each step as long as this preset costs",
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = engine.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV cache blocks (default: the runner's choice)")
    size.add_argument("--kv-memory-gb", type=float, help="KV cache size in GiB, instead of --num-blocks")
    engine.add_argument(
        "--max-batch-tokens", type=int, default=512, help="token budget of a step (default 512)"
    )
    engine.add_argument("--max-seqs", type=int, default=256, help="running sequences at most (default 256)")
    engine.add_argument(
        "--watermark", type=float, default=0.01, help="fraction of blocks admissions leave free"
    )
    engine.add_argument("--model-version", default="", help="prefix cache salt (default: the model's name)")
    engine.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    engine.add_argument(
        "--threads", type=int, default=1, help="torch's CPU threads (default 1: none spins on a shared core)"
    )
    engine.add_argument(
        "--sim-eos-prob", type=float, default=0.0, help="--simulated: chance a token ends its answer"
    )
    engine.add_argument(
        "--sim-vocab", type=int, default=None, help="--simulated: draw ids below this (128: ASCII)"
    )


def add_vllm_arguments(kinds: argparse._SubParsersAction) -> None:
    engine = kinds.add_parser("vllm-engine", help="vLLM's engine (LLMEngine), speaking ferry's engine frames")
    engine.add_argument("--model", metavar="DIR", required=True, help="a Hugging Face model directory")
    engine.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per block in stats (ferry's unit)")
    size = engine.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV cache in --block-size blocks (default: vLLM's)")
    size.add_argument("--kv-memory-gb", type=float, help="KV cache size in GiB, instead of --num-blocks")
    engine.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of a step")
    engine.add_argument("--max-seqs", type=int, default=256, help="running sequences at most")
    engine.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: model's)")
    engine.add_argument("--model-version", default="", help="prefix cache salt (default: the model's name)")
    engine.add_argument("--device", default=None, help="accepted for symmetry; vLLM's build decides")
    engine.add_argument("--compile", action="store_true", help="torch.compile (slow start, faster steps)")
    engine.add_argument("--threads", type=int, default=1, help="CPU threads of its steps (default 1)")
