"""Model speed: the paged ModelRunner against transformers' generate, side by side, on SmolLM2-135M.

    python -m experiments.model_speed [--batches 16 32] [--context 256] [--steps 16] [--dtypes ...]

A quick measurement to guide the model's performance work, not the engine benchmark: every
sequence has the same ``--context`` prompt tokens (no padding on either side), and each system
decodes ``--steps`` tokens for a whole batch at once.

- **prefill**: ours runs the first ``--prefill-seqs`` prompts as the engine would, in steps of
  ``--chunk`` tokens; transformers runs one forward pass over those [seqs, context] prompts into
  a fresh DynamicCache.
- **decode**: ours times ``--steps`` steps of one decode per sequence; transformers times
  ``generate(max_new_tokens=steps)`` continuing from a copy of the prefilled cache (greedy,
  no EOS stop), so both count decode steps only.
- **decode step**: one step of the largest batch, alternated ``5 x --rounds`` times: ours, and
  transformers' forward pass of one token on its cache (cropped back after) with the argmax.

``--rounds`` repeats every measurement, alternating the systems, and keeps each one's best: the
machine is shared, and the best of a few is the least disturbed.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from experiments.common import markdown
from workers.convert import ensure_converted
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.runner import ModelRunner
from workers.sampling import Sampling

GREEDY = Sampling(max_tokens=1 << 20, ignore_eos=True)


class Paged:
    """Our runner with ``batch`` sequences of ``context`` tokens, blocks interleaved in the cache."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], per_seq: int) -> None:
        """``per_seq`` blocks for each sequence: its prompt and every token it will decode."""
        self.runner, self.prompts = runner, prompts
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

    def prefill(self, chunk: int, seqs: int) -> float:
        """Seconds to compute the first ``seqs`` prompts, ``chunk`` tokens per step; each sequence
        then holds its prompt and the token sampled after it (a repeated prefill starts over)."""
        work = [(b, p) for b in range(seqs) for p in range(len(self.prompts[b]))]
        started = time.perf_counter()
        for start in range(0, len(work), chunk):
            part = work[start : start + chunk]
            members = sorted({b for b, _ in part})
            spans = {b: [p for bb, p in part if bb == b] for b in members}
            last = {b: spans[b][-1] == len(self.prompts[b]) - 1 for b in members}
            batch = ForwardBatch(
                input_ids=[self.prompts[b][p] for b, p in part],
                positions=[p for _, p in part],
                slot_mapping=[self._slot(b, p) for b, p in part],
                query_lens=[len(spans[b]) for b in members],
                context_lens=[spans[b][-1] + 1 for b in members],
                block_tables=[self.tables[b] for b in members],
                samples=[Sample(GREEDY, 0) if last[b] else None for b in members],
            )
            for b, token in zip(members, self.runner.execute(batch), strict=False):
                if token is not None:
                    self.tokens[b] = [*self.prompts[b], token]
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
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None
        self.ids = torch.tensor(prompts)
        self.cache = None

    @torch.inference_mode()
    def warm_up(self) -> None:
        self.model(self.ids[:1, :64])

    @torch.inference_mode()
    def prefill(self, seqs: int) -> float:
        """Seconds for one forward pass over the first ``seqs`` prompts (all but their last
        token, which generate feeds); the cache of a prefill of all is kept for decoding."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        started = time.perf_counter()
        self.model(self.ids[:seqs, :-1], past_key_values=cache, use_cache=True)
        elapsed = time.perf_counter() - started
        if seqs == self.ids.shape[0]:
            self.cache = cache
        return elapsed

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

    @torch.inference_mode()
    def step(self, batch: int) -> float:
        """Seconds for one decode step of the first ``batch`` sequences: a forward pass of their
        next token on the prefilled cache (then cropped back) and the argmax generate takes."""
        if batch < self.ids.shape[0]:
            raise ValueError(f"--batches: the step measurement runs the largest batch only, got {batch}")
        started = time.perf_counter()
        out = self.model(self.ids[:, -1:], past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(dim=-1).tolist()
        elapsed = time.perf_counter() - started
        self.cache.crop(-1)
        return elapsed


def row(dtype: str, phase: str, batch: int, ours: float, theirs: float) -> dict:
    print(
        f"{dtype} {phase} batch {batch}: ours {ours:.0f} tok/s, transformers {theirs:.0f} tok/s", flush=True
    )
    return {
        "dtype": dtype,
        "phase": phase,
        "batch": batch,
        "ours tok/s": ours,
        "transformers tok/s": theirs,
        "ours / transformers": ours / theirs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill step (ours)")
    parser.add_argument("--prefill-seqs", type=int, default=4, help="prompts per timed prefill")
    parser.add_argument("--rounds", type=int, default=3, help="repeats of each measurement: the best counts")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    model_dir = ensure_converted()
    largest = max(args.batches)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (largest, args.context), generator=generator).tolist()
    rows = []
    for dtype in args.dtypes:
        decoded = (args.steps * len(args.batches) + 5) * args.rounds  # per sequence, at most
        per_seq = -(-(args.context + decoded + 1) // 16)
        paged = Paged(ModelRunner(model_dir, num_blocks=largest * per_seq, dtype=dtype), prompts, per_seq)
        peer = Transformers(model_dir, getattr(torch, dtype), prompts)
        paged.warm_up()
        peer.warm_up()
        ours = theirs = float("inf")
        for _ in range(args.rounds):
            ours = min(ours, paged.prefill(args.chunk, args.prefill_seqs))
            theirs = min(theirs, peer.prefill(args.prefill_seqs))
        tokens = args.prefill_seqs * args.context
        rows.append(row(dtype, "prefill", args.prefill_seqs, tokens / ours, tokens / theirs))
        paged.prefill(args.chunk, largest)  # the contexts the decodes read
        peer.prefill(largest)
        for batch in args.batches:
            ours = theirs = float("inf")
            for _ in range(args.rounds):
                ours = min(ours, paged.decode(batch, args.steps))
                theirs = min(theirs, peer.decode(batch, args.steps))
            rows.append(row(dtype, "decode", batch, batch * args.steps / ours, batch * args.steps / theirs))
        # Single steps alternated many times: the least disturbed step of each, side by side.
        ours = theirs = float("inf")
        for _ in range(5 * args.rounds):
            ours = min(ours, paged.decode(largest, 1))
            theirs = min(theirs, peer.step(largest))
        rows.append(row(dtype, "decode step", largest, largest / ours, largest / theirs))
    print(markdown(rows))


if __name__ == "__main__":
    main()
