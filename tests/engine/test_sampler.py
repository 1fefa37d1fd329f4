"""The sampler: greedy, temperature, top-k, top-p, and seeds that hold whatever shares the batch."""

from __future__ import annotations

import collections

import pytest
import torch

from workers.engine.batch import Sample
from workers.engine.sampler import Sampler, stream_key
from workers.sampling import Sampling

VOCAB = 1000


def sample(temperature=1.0, top_k=0, top_p=1.0, seed=None, index=0) -> Sample:
    return Sample(Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed), index)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax():
    logits = random_logits(4)
    assert Sampler(torch.device("cpu"))(logits, [sample(temperature=0.0)] * 4) == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_token_alone_and_among_50_others():
    sampler = Sampler(torch.device("cpu"))
    logits = random_logits(51, seed=1)
    mine = sample(temperature=0.8, top_k=50, top_p=0.9, seed=1234, index=7)
    alone = sampler(logits[:1], [mine])
    others = [
        sample(
            temperature=0.5 + (i % 3) / 2,
            top_k=i % 4 * 10,
            top_p=1.0 - (i % 5) / 10,
            seed=i if i % 2 else None,
            index=i,
        )
        for i in range(50)
    ]
    others[::7] = [sample(temperature=0.0)] * len(others[::7])
    for position in (0, 25, 50):
        batch = list(others)
        batch.insert(position, mine)
        rows = torch.cat([logits[1 : position + 1], logits[:1], logits[position + 1 :]])
        assert sampler(rows, batch)[position] == alone[0]


def test_seed_and_index_pick_the_stream():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)  # uniform: every draw shows its stream
    draws = {
        (seed, index): sampler(logits, [sample(seed=seed, index=index)])[0]
        for seed in range(3)
        for index in range(3)
    }
    assert draws == {key: sampler(logits, [sample(seed=key[0], index=key[1])])[0] for key in draws}
    assert len(set(draws.values())) == len(draws)
    assert stream_key(1, 0) != stream_key(0, 1) and 0 <= stream_key(2**62, 10**9) < 2**63


def test_unseeded_rows_use_the_process_generator():
    logits = torch.zeros(8, VOCAB)
    first = Sampler(torch.device("cpu"), seed=5)(logits, [sample()] * 8)
    assert first == Sampler(torch.device("cpu"), seed=5)(logits, [sample()] * 8)
    assert first != Sampler(torch.device("cpu"), seed=6)(logits, [sample()] * 8)


def frequencies(logits: torch.Tensor, draws: int, **params) -> dict[int, float]:
    sampler = Sampler(torch.device("cpu"))
    tokens = sampler(logits.expand(draws, -1), [sample(seed=9, index=i, **params) for i in range(draws)])
    return {token: count / draws for token, count in collections.Counter(tokens).items()}


def test_temperature_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits[0] / temperature, dim=-1).tolist()
        seen = frequencies(logits, 4000, temperature=temperature)
        assert all(abs(seen.get(t, 0.0) - p) < 0.025 for t, p in enumerate(expected)), (temperature, seen)


def test_top_k_keeps_the_k_most_likely_renormalized():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    seen = frequencies(logits, 3000, top_k=2)
    assert set(seen) == {1, 3}
    assert abs(seen[1] - torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)[0].item()) < 0.03
    assert set(frequencies(logits, 200, top_k=1)) == {1}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert set(frequencies(logits, 2000, top_p=0.7)) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert set(frequencies(logits, 2000, top_p=0.85)) == {0, 1, 2}
    assert set(frequencies(logits, 200, top_p=0.01)) == {0}
    assert set(frequencies(logits, 4000)) == {0, 1, 2, 3}


def test_top_p_applies_to_what_top_k_kept():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_k=2 leaves 0.4 and 0.3, renormalized to 0.57 and 0.43: top_p 0.5 keeps token 0 alone
    assert set(frequencies(logits, 500, top_k=2, top_p=0.5)) == {0}
    # top_k=3 renormalizes to 0.44, 0.33, 0.22: 0.78 lies above token 2, past top_p 0.75 (before
    # renormalizing it would be 0.7, and token 2 would stay)
    assert set(frequencies(logits, 2000, top_k=3, top_p=0.75)) == {0, 1}
    assert set(frequencies(logits, 2000, top_k=3, top_p=0.8)) == {0, 1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_a_seeded_row_on_cuda_is_reproducible():
    sampler = Sampler(torch.device("cuda"))
    logits = random_logits(3, seed=2).cuda()
    params = [sample(seed=3, index=1), sample(temperature=0.0), sample()]
    assert sampler(logits, params)[:2] == sampler(logits, params)[:2]


def adjusted(logits: torch.Tensor, **params) -> Sample:
    """A greedy row with ``params`` (penalties, bias) over ``logits``' tokens."""
    prompt, output = params.pop("prompt", ()), params.pop("output", ())
    return Sample(Sampling(temperature=0.0, **params), len(output), prompt, output)


def test_logit_bias_moves_a_greedy_row_and_leaves_its_batch_mates_alone():
    logits = random_logits(3, seed=3)
    best = logits.argmax(-1).tolist()
    target = (best[1] + 1) % VOCAB
    rows = [sample(temperature=0.0), adjusted(logits, logit_bias=((target, 100.0),)), sample(temperature=0.0)]
    assert Sampler(torch.device("cpu"))(logits, rows) == [best[0], target, best[2]]
    banned = adjusted(logits, logit_bias=((best[1], -100.0),))
    assert Sampler(torch.device("cpu"))(logits[1:2], [banned])[0] != best[1]


def test_penalties_follow_vllm_s_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, 1.9]])
    sampler = Sampler(torch.device("cpu"))
    # repetition 2: token 0 (in the prompt) 2.0 -> 1.0, token 4 (in the output) 1.9 -> 0.95: token 2 wins
    assert sampler(logits, [adjusted(logits, repetition_penalty=2.0, prompt=[0], output=[4])]) == [2]
    # frequency 0.3 on token 0 seen twice: 2.0 - 0.6 = 1.4 < 1.5 (token 2) and < 1.9 (token 4)
    assert sampler(logits, [adjusted(logits, frequency_penalty=0.3, output=[0, 0])]) == [4]
    # presence 0.2 counts once: 2.0 - 0.2 = 1.8 < 1.9
    assert sampler(logits, [adjusted(logits, presence_penalty=0.2, output=[0, 0, 0])]) == [4]
    # a negative repetition-penalized logit is multiplied: -1.0 * 2 = -2.0, still not picked
    assert sampler(logits, [adjusted(logits, repetition_penalty=2.0, prompt=[1])]) == [0]


def test_min_p_keeps_tokens_at_least_that_share_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(torch.device("cpu"), seed=0)
    drawn = collections.Counter(
        sampler(logits, [Sample(Sampling(temperature=1.0, min_p=0.5), 0)])[0] for _ in range(400)
    )
    assert set(drawn) == {0, 1}  # 0.15 and 0.05 are under half of 0.5


def test_adjusted_rows_keep_their_seeded_draws_apart_from_their_batch_mates():
    logits = random_logits(6, seed=4)
    params = Sampling(temperature=0.9, seed=5, presence_penalty=0.5, logit_bias=((7, 3.0),))
    mine = Sample(params, 2, [1, 2], [7, 7])
    sampler = Sampler(torch.device("cpu"))
    alone = sampler(logits[:1], [mine])[0]
    mates = [adjusted(logits, frequency_penalty=1.0, output=[i]) for i in range(5)]
    assert sampler(logits, [mine, *mates])[0] == alone
