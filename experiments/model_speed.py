"""Model speed: the paged ModelRunner against transformers' generate, side by side, on SmolLM2-135M.

    python -m experiments.model_speed [--batches 16 32] [--context 256] [--steps 16] [--dtypes ...]

A quick measurement to guide the model's performance work, not the engine benchmark: every
sequence has the same ``--context`` prompt tokens (no padding on either side), and each system
decodes ``--steps`` tokens for a whole batch at once.

- **prefill**: ours runs the prompts as the engine would, in batches of ``--chunk`` tokens;
  transformers runs one forward pass over the whole [batch, context] prompt into a DynamicCache.
- **decode**: ours times ``--steps`` steps of one decode per sequence; transformers times
  ``generate(max_new_tokens=steps)`` continuing from a copy of that prefilled cache (greedy,
  no EOS stop), so both count decode steps only.

``--rounds`` repeats every decode measurement, alternating the systems, and keeps each one's
best: the machine is shared, and the best of a few is the least disturbed.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from experiments.common import markdown
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.convert import ensure_converted
from workers.engine.runner import ModelRunner
from workers.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)


class Paged:
    """Our runner with ``batch`` sequences of ``context`` tokens, blocks interleaved in the cache."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], steps: int, rounds: int) -> None:
        self.runner, self.prompts = runner, prompts
        bs = runner.block_size
        per_seq = -(-(len(prompts[0]) + steps * rounds + 1) // bs)
        # Sequence b owns blocks b, b + batch, b + 2 * batch, ...: never contiguous.
        self.tables = [[b + i * len(prompts) for i in range(per_seq)] for b in range(len(prompts))]
        self.tokens = [list(prompt) for prompt in prompts]

    def _slot(self, b: int, p: int) -> int:
        bs = self.runner.block_size
        return self.tables[b][p // bs] * bs + p % bs

    def warm_up(self) -> None:
        """One throwaway step into sequence 0's blocks (its prefill overwrites them): the first
        call of a kernel pays for its set-up."""
        n = min(64, len(self.prompts[0]))
        self.runner.execute(
            ForwardBatch(
                self.prompts[0][:n],
                list(range(n)),
                [self._slot(0, p) for p in range(n)],
                [n],
                [n],
                [self.tables[0]],
                [Sample(GREEDY, 0)],
            )
        )

    def prefill(self, chunk: int) -> float:
        """Seconds to compute every prompt, ``chunk`` tokens per step."""
        work = [(b, p) for b, prompt in enumerate(self.prompts) for p in range(len(prompt))]
        started = time.perf_counter()
        for start in range(0, len(work), chunk):
            part = work[start : start + chunk]
            seqs = sorted({b for b, _ in part})
            spans = {b: [p for bb, p in part if bb == b] for b in seqs}
            samples = [Sample(GREEDY, 0) if spans[b][-1] == len(self.prompts[b]) - 1 else None for b in seqs]
            batch = ForwardBatch(
                input_ids=[self.prompts[b][p] for b, p in part],
                positions=[p for _, p in part],
                slot_mapping=[self._slot(b, p) for b, p in part],
                query_lens=[len(spans[b]) for b in seqs],
                context_lens=[spans[b][-1] + 1 for b in seqs],
                block_tables=[self.tables[b] for b in seqs],
                samples=samples,
            )
            for b, token in zip(seqs, self.runner.execute(batch)):
                if token is not None:
                    self.tokens[b].append(token)
        return time.perf_counter() - started

    def decode(self, batch: int, steps: int) -> float:
        """Seconds for ``steps`` steps of the first ``batch`` sequences, one token each."""
        started = time.perf_counter()
        for _ in range(steps):
            positions = [len(self.tokens[b]) - 1 for b in range(batch)]
            step = ForwardBatch(
                input_ids=[self.tokens[b][-1] for b in range(batch)],
                positions=positions,
                slot_mapping=[self._slot(b, p) for b, p in enumerate(positions)],
                query_lens=[1] * batch,
                context_lens=[p + 1 for p in positions],
                block_tables=self.tables[:batch],
                samples=[Sample(GREEDY, len(self.tokens[b]) - len(self.prompts[b])) for b in range(batch)],
            )
            for b, token in enumerate(self.runner.execute(step)):
                self.tokens[b].append(token)
        return time.perf_counter() - started


class Transformers:
    def __init__(self, model_dir, dtype: torch.dtype, prompts: list[list[int]]) -> None:
        from transformers import DynamicCache, LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None
        self.ids = torch.tensor(prompts)
        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def warm_up(self) -> None:
        self.model(self.ids[:1, :64])

    @torch.inference_mode()
    def prefill(self) -> float:
        started = time.perf_counter()
        self.model(self.ids[:, :-1], past_key_values=self.cache, use_cache=True)
        return time.perf_counter() - started

    @torch.inference_mode()
    def decode(self, batch: int, steps: int) -> float:
        from transformers import GenerationConfig

        cache = copy.deepcopy(self.cache)
        if batch < self.ids.shape[0]:
            cache.batch_select_indices(torch.arange(batch))
        config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        started = time.perf_counter()
        self.model.generate(self.ids[:batch], past_key_values=cache, generation_config=config)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill step (ours)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    model_dir = ensure_converted()
    largest = max(args.batches)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (largest, args.context), generator=generator).tolist()
    rows = []
    for dtype in args.dtypes:
        blocks = largest * (-(-(args.context + args.steps * args.rounds * len(args.batches) + 1) // 16))
        paged = Paged(
            ModelRunner(model_dir, num_blocks=blocks, dtype=dtype),
            prompts,
            args.steps * len(args.batches),
            args.rounds,
        )
        peer = Transformers(model_dir, getattr(torch, dtype), prompts)
        paged.warm_up()
        peer.warm_up()
        ours_prefill, theirs_prefill = paged.prefill(args.chunk), peer.prefill()
        tokens = largest * args.context
        rows.append(
            {
                "dtype": dtype,
                "phase": "prefill",
                "batch": largest,
                "ours tok/s": tokens / ours_prefill,
                "transformers tok/s": tokens / theirs_prefill,
                "ratio": theirs_prefill / ours_prefill,
            }
        )
        print(rows[-1], flush=True)
        for batch in args.batches:
            ours = theirs = float("inf")
            for _ in range(args.rounds):
                ours = min(ours, paged.decode(batch, args.steps))
                theirs = min(theirs, peer.decode(batch, args.steps))
            rows.append(
                {
                    "dtype": dtype,
                    "phase": "decode",
                    "batch": batch,
                    "ours tok/s": batch * args.steps / ours,
                    "transformers tok/s": batch * args.steps / theirs,
                    "ratio": theirs / ours,
                }
            )
            print(rows[-1], flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
