"""Pick each sequence's next token from its logits: greedy, or temperature, min-p, top-k and
top-p, after the request's own changes to them (``logit_bias`` and penalties:
:mod:`workers.engine.logits`).

Sampling is an exponential race: with ``E_i`` drawn from Exp(1), ``argmax_i p_i / E_i`` is token
``i`` with probability ``p_i`` (the Gumbel-max trick in another dress), so a row's draw is one
vector of noise and an argmax, vectorized over the batch. A row with a seed draws its noise from
a generator seeded by ``(seed, index)``, ``index`` being how many tokens the sequence has: its
token depends neither on its batch mates nor on a preemption that made it recompute. Filters run
in temperature, min-p, top-k, top-p order (vLLM's); a filter is off at its neutral value (min_p
0, top_k 0, top_p 1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from workers.engine.batch import Sample
from workers.engine.logits import adjust

_MASK64 = (1 << 64) - 1


def stream_key(seed: int, index: int) -> int:
    """A 63-bit generator seed for output token ``index`` of a request seeded with ``seed``
    (splitmix64's finalizer over both, so nearby seeds and indexes give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Turns a [rows, vocab] logits tensor and one :class:`Sample` per row into token ids."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else seed)
        self.seeded = torch.Generator(device=device)  # re-seeded for each seeded row it draws

    def __call__(self, logits: torch.Tensor, samples: Sequence[Sample]) -> list[int]:
        logits = adjust(logits, samples)
        tokens = argmax(logits)
        drawn = [row for row, sample in enumerate(samples) if not sample.params.greedy]
        if drawn:
            index = torch.tensor(drawn, device=logits.device)
            tokens[index] = self._draw(logits.index_select(0, index).float(), [samples[r] for r in drawn])
        return tokens.tolist()

    def _draw(self, logits: torch.Tensor, samples: list[Sample]) -> torch.Tensor:
        params = [sample.params for sample in samples]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.min_p for p in params):
            logits = _min_p(logits, [p.min_p for p in params])
        if any(p.top_k or p.top_p < 1.0 for p in params):
            logits = _filter(logits, [p.top_k for p in params], [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        return argmax(probs / self._noise(probs.shape, samples))

    def _noise(self, shape: torch.Size, samples: list[Sample]) -> torch.Tensor:
        """Exp(1) noise, one row per sample: its own stream if seeded, the process one if not."""
        noise = torch.empty(shape, device=self.device)
        unseeded = [row for row, sample in enumerate(samples) if sample.params.seed is None]
        if unseeded:
            rows = torch.empty(len(unseeded), shape[1], device=self.device).exponential_(
                generator=self.generator
            )
            noise[torch.tensor(unseeded, device=self.device)] = rows
        for row, sample in enumerate(samples):
            if sample.params.seed is not None:
                self.seeded.manual_seed(stream_key(sample.params.seed, sample.index))
                noise[row].exponential_(generator=self.seeded)
        return noise.clamp_min_(1e-10)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index. On the CPU numpy's vectorized argmax takes a tenth of
    torch's over a vocabulary-wide row (the same index: both take the first of ties)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Logits of tokens less likely than ``min_p`` times the row's most likely one set to -inf."""
    probs = torch.softmax(logits, dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=logits.device)[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits outside each row's top-k, then outside its top-p nucleus, set to -inf."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.tensor([k or vocab for k in top_k], device=logits.device)
    ordered = ordered.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # A token stays while the mass ranked above it is below top_p: the first always stays.
    before = probs.cumsum(dim=-1) - probs
    p = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=logits.device)
    ordered = ordered.masked_fill(before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, ordered)
