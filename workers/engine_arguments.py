"""The command lines of the two engine kinds, ``engine`` (ferry's continuous engine,
workers/engine/serve.py) and ``vllm-engine`` (vLLM's, workers/vllm_engine.py), apart from the
engines themselves: every worker parses its command line with these whatever its kind, and only
a worker that runs an engine imports one, so a fixed-mode worker starts without the engine's
imports. Their defaults are the engine's own (:mod:`workers.engine.config`).
"""

from __future__ import annotations

import argparse

from workers.engine.config import DEFAULTS, DTYPE, DTYPES, THREADS, WEIGHTS
from workers.engine.cost_model import PRESETS


def add_engine_arguments(kinds: argparse._SubParsersAction) -> None:
    engine = kinds.add_parser(
        "engine", help="ferry's continuous engine: paged KV cache, one token budget a step"
    )
    source = engine.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a Hugging Face model directory")
    source.add_argument(
        "--simulated",
        choices=sorted(PRESETS),
        help="no model: seeded tokens, each step as long as this preset costs",
    )
    _add_shared(engine, blocks="KV cache blocks (default: the runner's choice)",
                block_size="tokens per KV block (default %(default)s)")
    engine.add_argument("--watermark", type=float, default=DEFAULTS.watermark,
                        help="fraction of blocks admissions leave free (default %(default)s)")
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    engine.add_argument("--weights", choices=WEIGHTS, default=WEIGHTS[0],
                        help="bf16; int8 or int4 too for few-row steps (bfloat16, CPU; default %(default)s)")
    engine.add_argument("--prefill-slots", type=int, default=0,
                        help="the pool's slots below this run prefill only and hand each sequence "
                             "off after its first token (default %(default)s: none)")
    engine.add_argument("--kv-shm", action="store_true",
                        help="a prefill engine hands KV off in /dev/shm files, not frames: only "
                             "when every decode engine runs on this host")
    engine.add_argument(
        "--step-costs", metavar="FILE", default=None,
        help="step costs `ferry fit` wrote: the prices that hold the tiers' TPOT targets "
             "(default: a simulated engine's preset; a model without them holds no target)",
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
    _add_shared(engine, blocks="KV cache in --block-size blocks (default: vLLM's)",
                block_size="tokens per block in stats, ferry's unit (default %(default)s)")
    engine.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: model's)")
    engine.add_argument("--device", default=None, help="accepted for symmetry; vLLM's build decides")
    engine.add_argument("--compile", action="store_true", help="torch.compile (slow start, faster steps)")


def _add_shared(engine: argparse.ArgumentParser, blocks: str, block_size: str) -> None:
    """The settings both engines take, with the engine's defaults."""
    engine.add_argument("--block-size", type=int, default=DEFAULTS.block_size, help=block_size)
    size = engine.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help=blocks)
    size.add_argument("--kv-memory-gb", type=float, help="KV cache size in GiB, instead of --num-blocks")
    engine.add_argument("--max-batch-tokens", type=int, default=DEFAULTS.max_batch_tokens,
                        help="token budget of a step (default %(default)s)")
    engine.add_argument("--max-seqs", type=int, default=DEFAULTS.max_seqs,
                        help="running sequences at most (default %(default)s)")
    engine.add_argument("--model-version", default="", help="prefix cache salt (default: the model's name)")
    engine.add_argument("--dtype", choices=DTYPES, default=DTYPE, help="weights and KV (default %(default)s)")
    engine.add_argument("--threads", type=int, default=THREADS,
                        help="torch's CPU threads of a step (default %(default)s)")
