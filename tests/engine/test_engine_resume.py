"""A sequence resumed on another engine (``add(..., output_ids=...)``, what the pool sends when a
stream's engine died under ``on_engine_loss = "resume"``) continues with the tokens the first
engine would have made, on SmolLM2-135M in float32: greedy, seeded sampling (the seed and the
sampling index carry over) and penalties (they read the resumed output as output), resumed
together on a fresh engine, in chunks, at two points of their blocks.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling import Sampling

SAMPLINGS = {
    "greedy": Sampling(max_tokens=14, ignore_eos=True),
    "seeded": Sampling(max_tokens=14, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True),
    "penalized": Sampling(max_tokens=14, temperature=0.7, seed=5, frequency_penalty=1.5, presence_penalty=0.5,
                          repetition_penalty=1.3, ignore_eos=True),
}


def answers(runner, prompt: list[int], samplings: dict[str, Sampling],
            resumed: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """The tokens a fresh engine makes for ``prompt`` under each sampling, sharing its steps
    (prefilled in chunks of 16 tokens), each after its ``resumed`` tokens."""
    engine = Engine(runner, EngineConfig(block_size=runner.block_size, num_blocks=runner.num_blocks,
                                         max_batch_tokens=16, max_seqs=4, watermark=0.0))
    rids = {engine.add(prompt, sampling, output_ids=(resumed or {}).get(name, [])): name
            for name, sampling in samplings.items()}
    made: dict[str, list[int]] = {name: [] for name in samplings}
    while engine.has_work:
        for rid, token in engine.step().tokens.items():
            made[rids[rid]].append(token)
    return made


def test_resumed_sequences_make_the_tokens_an_uninterrupted_run_makes(smollm2, smollm2_runner):
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    prompt = tokenizer.encode("Once upon a time, in a town by the sea,").ids
    whole = answers(smollm2_runner, prompt, SAMPLINGS)
    assert all(len(tokens) == 14 for tokens in whole.values())
    for cut in (1, 9):  # after the first token; mid-block, 12 + 9 tokens into its cache
        resumed = answers(smollm2_runner, prompt, SAMPLINGS, {name: whole[name][:cut] for name in SAMPLINGS})
        assert resumed == {name: whole[name][cut:] for name in SAMPLINGS}
    unseeded = SAMPLINGS["seeded"].replace(seed=None)
    other = answers(smollm2_runner, prompt, {"seeded": unseeded}, {"seeded": whole["seeded"][:9]})
    assert other["seeded"] != whole["seeded"][9:]  # the seed, not luck, carries a sampled run on
