"""The models a fixed-mode worker can run: each is ``run_batch(inputs) -> outputs``.

``sleep`` is the reference GPU of seed 000 §7.1: every call costs the same (200 ms) whatever
the batch size, and each output is its input reversed, so anyone can tell which input an output
belongs to. ``echo`` answers at once. ``classify`` does real batched tensor work with torch (on
CUDA when the worker's ``CUDA_VISIBLE_DEVICES`` shows one, else on CPU): a byte-level network
with seeded random weights that labels each input, whatever else shares its batch. ``llm`` is a
Llama checkpoint answering prompts by static batching: each call is one padded batch that waits
for its longest answer (the baseline the continuous engine is measured against).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Protocol


class Model(Protocol):
    """What the worker loop calls; one call at a time."""

    name: str

    def run_batch(self, inputs: list[str]) -> list[str]: ...


def mirror(inputs: list[str]) -> list[str]:
    """Each input reversed: the reference transform, reversible, so an output names its input."""
    return [text[::-1] for text in inputs]


class Sleep:
    """The reference GPU: a fixed cost per call, any size; outputs are the inputs reversed."""

    def __init__(self, latency_ms: float) -> None:
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

    def __init__(self, dim: int, layers: int, labels: int, max_bytes: int, seed: int) -> None:
        import torch  # only this model needs it; `sleep` workers start in milliseconds

        self._torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


class LLM:
    """A Llama checkpoint (a Hugging Face directory) as a fixed-mode model: each input is a
    prompt's text, taken as given (the gateway has applied the chat template), each output the
    text of its greedy answer, up to ``max_new_tokens`` tokens or the model's EOS. A call runs
    as one padded batch that waits for its longest answer (:mod:`workers.engine.static`).
    """

    def __init__(self, model_dir: str, dtype: str, max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"llm --max-new-tokens: expected >= 1, got {max_new_tokens}")
        from tokenizers import Tokenizer  # only this model needs them

        from workers.engine.static import StaticBatcher

        self.batcher = StaticBatcher(model_dir, dtype=dtype)
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.max_new_tokens = max_new_tokens
        self.name = f"llm-{os.path.basename(os.path.normpath(model_dir))}"

    def run_batch(self, inputs: list[str]) -> list[str]:
        """The answers' texts, in order; a ValueError names an input with no tokens or one the
        model's context cannot hold with its answer."""
        prompts = [self.tokenizer.encode(text).ids for text in inputs]
        answers = self.batcher.generate(prompts, [self.max_new_tokens] * len(prompts))
        return [self.tokenizer.decode(answer) for answer in answers]


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
    llm = kinds.add_parser("llm", help="a Llama checkpoint answering each batch as one padded batch")
    llm.add_argument("--model", metavar="DIR", required=True, help="a Hugging Face model directory")
    llm.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    llm.add_argument(
        "--max-new-tokens", type=int, default=256, help="answer tokens at most, per input (default 256)"
    )


def load_model(args: argparse.Namespace) -> Model:
    """Build the model the command line names."""
    if args.kind == "sleep":
        return Sleep(args.latency_ms)
    if args.kind == "echo":
        return Echo()
    if args.kind == "llm":
        return LLM(args.model, args.dtype, args.max_new_tokens)
    return Classify(args.dim, args.layers, args.labels, args.max_bytes, args.weights_seed)
