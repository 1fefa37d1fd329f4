"""What a request changes in its logits before a token is picked, greedy or not, in vLLM's order:
``logit_bias`` added, then the penalties (repetition on the prompt's and the output's tokens,
frequency and presence on the output's). Batched: one index operation per kind over every row
that asks for it, however many rows; a row that asks for none is not touched.

    repetition r:  a seen token's logit l becomes l / r if l > 0, else l * r
    frequency f:   l - f * (times the token is in the output)
    presence p:    l - p * (1 if the token is in the output)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.batch import Sample


def adjust(logits: torch.Tensor, samples: Sequence[Sample]) -> torch.Tensor:
    """``logits`` [rows, vocab] with each row's bias and penalties applied (a new tensor if any)."""
    rows = [row for row, sample in enumerate(samples) if sample.params.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    params = [samples[row].params for row in rows]
    biased = [(row, token, bias) for row, p in zip(rows, params, strict=True) for token, bias in p.logit_bias]
    if biased:
        at, token, bias = (torch.tensor(column, device=logits.device) for column in zip(*biased, strict=True))
        logits.index_put_((at, token), bias, accumulate=True)
    repeated = [row for row, p in zip(rows, params, strict=True) if p.repetition_penalty != 1.0]
    if repeated:
        _repetition(logits, repeated, samples)
    counted = [row for row, p in zip(rows, params, strict=True) if p.frequency_penalty or p.presence_penalty]
    if counted:
        _frequency_and_presence(logits, counted, samples)
    return logits


def _repetition(logits: torch.Tensor, rows: list[int], samples: Sequence[Sample]) -> None:
    """Each row's prompt and output tokens divided (positive logits) or multiplied by its penalty."""
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    seen = torch.unique(torch.cat([_at(row, vocab, [*samples[row].prompt, *samples[row].output], device)
                                   for row in rows]))
    factors = torch.ones(logits.shape[0], device=device)
    factors[torch.tensor(rows, device=device)] = torch.tensor(
        [samples[row].params.repetition_penalty for row in rows], device=device
    )
    factor, values = factors[seen // vocab], flat[seen]
    flat[seen] = torch.where(values > 0, values / factor, values * factor)


def _frequency_and_presence(logits: torch.Tensor, rows: list[int], samples: Sequence[Sample]) -> None:
    """Each row's output tokens counted (one index_add over every row), then penalized."""
    vocab, device = logits.shape[1], logits.device
    at = torch.cat([_at(slot, vocab, samples[row].output, device) for slot, row in enumerate(rows)])
    counts = torch.zeros(len(rows) * vocab, device=device)
    counts = counts.index_add_(0, at, torch.ones(len(at), device=device)).view(len(rows), vocab)
    frequency = torch.tensor([samples[row].params.frequency_penalty for row in rows], device=device)
    presence = torch.tensor([samples[row].params.presence_penalty for row in rows], device=device)
    index = torch.tensor(rows, device=device)
    logits[index] -= counts * frequency[:, None] + (counts > 0) * presence[:, None]


def _at(row: int, vocab: int, ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Token ids of one row as positions in the flattened [rows, vocab] logits."""
    return torch.as_tensor(ids, dtype=torch.long, device=device) + row * vocab
