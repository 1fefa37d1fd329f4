"""The built-in models of the fixed mode: each a target of the worker API (:mod:`workers.api`), as a
user's own model is, and each a kind of ``python -m workers`` (:data:`BUILT_IN`).

``sleep`` is the reference GPU of the fixed mode's contract: every call costs the same (200 ms) whatever
the batch size, and each output is its input reversed, so anyone can tell which input an output
belongs to. ``echo`` answers at once. ``classify`` does real batched tensor work with torch (on
CUDA when the worker's ``CUDA_VISIBLE_DEVICES`` shows one, else on CPU): a byte-level network
with seeded random weights that labels each input, whatever else shares its batch. ``generate``
runs a language model the way a fixed-mode fleet must: each call one static batch (below).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any


def mirror(inputs: list[str]) -> list[str]:
    """Each input reversed: the reference transform, reversible, so an output names its input."""
    return [text[::-1] for text in inputs]


class Sleep:
    """The reference GPU: a fixed cost per call, any size; outputs are the inputs reversed."""

    def __init__(self, latency_ms: float = 200.0) -> None:
        if latency_ms < 0:
            raise ValueError(f"sleep --latency-ms: expected >= 0, got {latency_ms}")
        self.name = f"sleep-{latency_ms:g}ms"
        self._latency = latency_ms / 1000

    def run_batch(self, inputs: list[str]) -> list[str]:
        time.sleep(self._latency)
        return mirror(inputs)


class Echo:
    """No cost at all: each output is its input."""

    name = "echo"

    def run_batch(self, inputs: list[str]) -> list[str]:
        return list(inputs)


class Classify:
    """A byte-level network in torch: embed bytes, masked mean, an MLP, argmax over labels.

    The masked mean makes each input's label independent of the padding its batch needs, so a
    batch of 50 answers exactly what 50 calls of one would: batching changes cost, not results.
    """

    def __init__(self, dim: int = 256, layers: int = 4, labels: int = 16, max_bytes: int = 2048,
                 seed: int = 0, device: str = "cpu") -> None:
        import torch  # only this model needs it; `sleep` workers start in milliseconds

        self._torch = torch
        self.device = torch.device(device)
        self.name = f"classify-d{dim}-l{layers}-{self.device.type}"
        self._max_bytes = max_bytes
        generator = torch.Generator().manual_seed(seed)
        self._embed = torch.randn(256, dim, generator=generator).to(self.device)
        self._hidden = [
            (torch.randn(dim, dim, generator=generator) / dim**0.5).to(self.device) for _ in range(layers)
        ]
        self._head = torch.randn(dim, labels, generator=generator).to(self.device)

    def run_batch(self, inputs: list[str]) -> list[str]:
        torch = self._torch
        encoded = [text.encode()[: self._max_bytes] for text in inputs]
        width = max(1, max(len(data) for data in encoded))
        ids = torch.zeros(len(encoded), width, dtype=torch.long)
        mask = torch.zeros(len(encoded), width, 1)
        for row, data in enumerate(encoded):
            if data:
                ids[row, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                mask[row, : len(data)] = 1.0
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            pooled = (self._embed[ids] * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            for weight in self._hidden:
                pooled = torch.nn.functional.gelu(pooled @ weight) + pooled
            labels = (pooled @ self._head).argmax(dim=1).tolist()
        return [f"label-{label}" for label in labels]


class Generate:
    """A language model behind the fixed-mode contract: each ``run_batch`` is one static batch,
    generated greedily by the continuous engine's own runner (same weights, same kernels), the
    way a static batcher must run it: every prompt prefilled in one step, then a decode step for
    every row until the *longest* answer ends (its end-of-sequence id, or ``max_tokens``). A row
    that has ended keeps decoding as padding, and the next batch waits for this one. That is what
    continuous batching is measured against (``experiments/continuous_vs_fixed.py``).

    ``run_batch`` gets strings only, so ``max_tokens`` is the worker's, the same for every row;
    the gateway cuts each answer at its request's own ``max_tokens``.
    """

    def __init__(self, runner, encode, decode, max_tokens: int, name: str) -> None:
        if max_tokens < 1:
            raise ValueError(f"generate --max-tokens: expected >= 1, got {max_tokens}")
        self.name = name
        self._runner, self._encode, self._decode, self._max_tokens = runner, encode, decode, max_tokens

    def run_batch(self, inputs: list[str]) -> list[str]:
        prompts = [self._encode(text) for text in inputs]
        return [self._decode(answer) for answer in self.generate(prompts, [self._max_tokens] * len(prompts))]

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool = False
    ) -> list[list[int]]:
        """The static batch in token ids: row ``i`` ends at its end-of-sequence id (not kept,
        unless ``ignore_eos``) or after ``max_tokens[i]`` tokens, and keeps decoding as padding
        until every row has ended (``experiments/engine_bench.py`` gives each its own length)."""
        from workers.engine.config import EngineConfig
        from workers.engine.engine import Engine
        from workers.sampling import Sampling

        runner = self._runner
        budget = max(len(prompts), sum(map(len, prompts)))  # the whole batch's prefill in one step
        config = EngineConfig(runner.block_size, runner.num_blocks, budget, len(prompts), watermark=0.0)
        engine = Engine(runner, config)
        padded = Sampling(max_tokens=max(max_tokens), ignore_eos=True)  # rows never leave early
        rids = [engine.add(prompt, padded) for prompt in prompts]
        limits = dict(zip(rids, max_tokens, strict=True))
        answers: dict[int, list[int]] = {rid: [] for rid in rids}
        ended: set[int] = set()
        while len(ended) < len(rids) and engine.has_work:
            step = engine.step()
            for rid, token in step.tokens.items():
                if rid in ended:
                    continue  # padding: computed, not kept
                if token in runner.eos_token_ids and not ignore_eos:
                    ended.add(rid)
                    continue
                answers[rid].append(token)
                if len(answers[rid]) == limits[rid]:
                    ended.add(rid)
            ended.update(done.rid for done in step.finished)
        for rid in rids:
            engine.abort(rid)  # the rows still padding
        return [answers[rid] for rid in rids]


def load_generate(model: str, max_tokens: int = 256, dtype: str = "float32", device: str | None = None,
                  kv_memory_gb: float | None = None) -> Generate:
    """A Hugging Face model directory's runner and tokenizer (torch, tokenizers)."""
    import os

    from tokenizers import Tokenizer

    from workers.engine.runner import ModelRunner

    runner = ModelRunner(model, dtype=dtype, device=device, kv_memory_gb=kv_memory_gb)
    vocabulary = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return vocabulary.encode(text, add_special_tokens=False).ids

    name = f"generate-{os.path.basename(os.path.normpath(model))}"
    return Generate(runner, encode, vocabulary.decode, max_tokens, name)


def add_model_arguments(kinds: argparse._SubParsersAction) -> None:
    """One sub-command per model kind, each with that model's own options."""
    sleep = kinds.add_parser("sleep", help="the 200 ms reference GPU")
    sleep.add_argument("--latency-ms", type=float, default=200.0, help="cost of every call (default 200)")
    kinds.add_parser("echo", help="answers at once")
    classify = kinds.add_parser("classify", help="a torch network that labels each input")
    classify.add_argument("--dim", type=int, default=256)
    classify.add_argument("--layers", type=int, default=4)
    classify.add_argument("--labels", type=int, default=16)
    classify.add_argument("--max-bytes", type=int, default=2048)
    classify.add_argument("--weights-seed", type=int, default=0)
    generate = kinds.add_parser("generate", help="a language model, one static padded greedy batch a call")
    generate.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model directory")
    generate.add_argument(
        "--max-tokens", type=int, default=256, help="tokens each row may generate (default 256)"
    )
    generate.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    generate.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    generate.add_argument("--kv-memory-gb", type=float, default=None, help="KV cache size (default 1)")
    model = kinds.add_parser("model", help="a model of your own, by import path (docs/workers.md)")
    model.add_argument("target", metavar="MODULE:NAME", help="a class or a factory, e.g. my_pkg.embed:MiniLM")
    model.add_argument("--pythonpath", action="append", default=[], metavar="DIR",
                       help="a directory put first on the import path (repeatable)")
    model.add_argument("--options", type=_options, default={}, metavar="JSON",
                       help="its keyword arguments, a JSON object (default {})")


def _options(text: str) -> dict[str, Any]:
    options = json.loads(text)
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text[:80]!r}")
    return options


def target_of(args: argparse.Namespace) -> tuple[str, dict[str, Any], list[str]]:
    """What a fixed-mode worker's command line builds: its target, options and import path."""
    if args.kind == "model":
        return args.target, args.options, args.pythonpath
    target, options = BUILT_IN[args.kind]
    return target, options(args), []


BUILT_IN: dict[str, tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "sleep": ("workers.models:Sleep", lambda args: {"latency_ms": args.latency_ms}),
    "echo": ("workers.models:Echo", lambda args: {}),
    "classify": ("workers.models:Classify", lambda args: {
        "dim": args.dim, "layers": args.layers, "labels": args.labels, "max_bytes": args.max_bytes,
        "seed": args.weights_seed}),
    "generate": ("workers.models:load_generate", lambda args: {
        "model": args.model, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "kv_memory_gb": args.kv_memory_gb, **({"device": args.device} if args.device else {})}),
}
"""Each built-in kind: its target in the worker API, and its options from its command line."""
