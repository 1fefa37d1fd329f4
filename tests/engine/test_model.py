"""The paged model against two oracles, on tiny random checkpoints, in float32: a naive
full-recompute forward of the same weights (tests/support/oracles.py) and transformers'
``LlamaForCausalLM.generate``. Batches come from tests/support/paged_driver.py: staggered arrivals,
uneven prefill chunks beside decodes, blocks reused right after another sequence freed them.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer

from gateway.text.model_template import read_chat_template
from tests.support.oracles import NaiveLlama, transformers_greedy
from tests.support.paged_driver import PagedDriver, Request
from tests.support.tiny_checkpoint import CHAT_TEMPLATE
from workers.engine.attention import partition, plan_attention
from workers.engine.batch import ForwardBatch, Sample
from workers.engine.checkpoint import LlamaConfig, Rope, read_rope
from workers.engine.runner import ModelRunner
from workers.sampling import Sampling

GREEDY = Sampling(max_tokens=64)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def mixed_requests(vocab: int, count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 20),
            arrival=rng.randint(0, 25),
            params=GREEDY,
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("name", ["tied", "untied-llama3", "tied-linear"])
def test_interleaved_greedy_equals_naive_and_transformers(tiny_checkpoints, name):
    model_dir = tiny_checkpoints[name]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=48)
    requests = sorted(mixed_requests(runner.config.vocab_size, 14, seed=len(name)), key=lambda r: r.arrival)
    driver = PagedDriver(runner, seed=3)
    paged = driver.run(requests)
    assert driver.mixed_steps >= 5 and driver.reused_blocks >= 20  # the workload did interleave and reuse
    naive = NaiveLlama(model_dir)
    assert paged == [naive.greedy(r.prompt, r.max_tokens) for r in requests]
    assert paged == transformers_greedy(
        model_dir, [r.prompt for r in requests], [r.max_tokens for r in requests]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_logits_equal_naive(tiny_checkpoints, device):
    """One batch: a decode, a first prefill chunk, a middle one and a last one, out of order
    in their blocks; every sampled row's logits are the naive model's at that position."""
    model_dir = tiny_checkpoints["untied-llama3"]
    runner = ModelRunner(model_dir, block_size=4, num_blocks=32, device=device)
    runner.kv_cache.normal_(0.0, 3.0)
    rng = random.Random(5)
    a, b, c = ([rng.randrange(3, runner.config.vocab_size) for _ in range(n)] for n in (11, 9, 14))
    tables = {"a": [9, 2, 30], "b": [5, 17, 0], "c": [31, 1, 8, 12]}

    def entries(name, tokens, start, end, sample):
        table = tables[name]
        return {
            "ids": tokens[start:end],
            "positions": list(range(start, end)),
            "slots": [table[p // 4] * 4 + p % 4 for p in range(start, end)],
            "query_len": end - start,
            "context_len": end,
            "table": table,
            "sample": Sample(GREEDY, 0) if sample else None,
        }

    def run(parts):
        batch = ForwardBatch(
            [i for p in parts for i in p["ids"]],
            [i for p in parts for i in p["positions"]],
            [i for p in parts for i in p["slots"]],
            [p["query_len"] for p in parts],
            [p["context_len"] for p in parts],
            [p["table"] for p in parts],
            [p["sample"] for p in parts],
        )
        return runner.logits(batch).cpu()

    run([entries("a", a, 0, 10, False), entries("c", c, 0, 5, False)])
    logits = run([entries("c", c, 5, 9, False), entries("a", a, 10, 11, True), entries("b", b, 0, 9, True)])
    naive = NaiveLlama(model_dir)
    torch.testing.assert_close(logits[0], naive.logits(a)[10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], naive.logits(b)[8], atol=1e-4, rtol=1e-4)
    logits = run([entries("c", c, 9, 14, True)])
    torch.testing.assert_close(logits[0], naive.logits(c)[13], atol=1e-4, rtol=1e-4)


def test_a_sequence_in_blocks_another_just_left_starts_at_position_0(tiny_checkpoint):
    """The position-carried-over bug of continuous batching: the second sequence takes exactly
    the blocks the first freed, last-freed first, and answers as if it were alone."""
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=6)
    rng = random.Random(11)
    first, second = ([rng.randrange(3, runner.config.vocab_size) for _ in range(n)] for n in (17, 13))
    driver = PagedDriver(runner, seed=1, max_chunk=5)
    outputs = driver.run([Request(first, 7), Request(second, 9, arrival=1)])
    assert driver.tables == {0: [0, 1, 2, 3, 4, 5], 1: [5, 4, 3, 2, 1, 0]}
    naive = NaiveLlama(tiny_checkpoint)
    assert outputs == [naive.greedy(first, 7), naive.greedy(second, 9)]


def test_chunk_sizes_do_not_change_the_answer(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=16)
    prompt = [random.Random(2).randrange(3, runner.config.vocab_size) for _ in range(37)]
    table = [15, 3, 9, 0, 12, 7, 1, 11, 4, 6]
    last = []
    for chunks in ([37], [1] * 37, [5, 11, 21], [36, 1]):
        runner.kv_cache.normal_(0.0, 3.0)
        start = 0
        for size in chunks:
            end = start + size
            batch = ForwardBatch(
                prompt[start:end],
                list(range(start, end)),
                [table[p // 4] * 4 + p % 4 for p in range(start, end)],
                [size],
                [end],
                [table],
                [Sample(GREEDY, 0) if end == len(prompt) else None],
            )
            logits = runner.logits(batch)
            start = end
        last.append(logits[0])
    for logits in last[1:]:
        torch.testing.assert_close(logits, last[0], atol=1e-4, rtol=1e-4)


def test_execute_answers_only_the_sequences_it_samples(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=8)
    batch = ForwardBatch(
        [5, 6, 7, 8], [0, 1, 2, 0], [0, 1, 2, 4], [3, 1], [3, 1], [[0], [1]], [None, Sample(GREEDY, 0)]
    )
    tokens = runner.execute(batch)
    assert tokens[0] is None and tokens[1] == NaiveLlama(tiny_checkpoint).greedy([8], 1)[0]


def test_runner_reads_the_checkpoint(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint, kv_memory_gb=0.001)
    assert runner.eos_token_ids == frozenset({0, 2})  # config.json's 2 and generation_config's [0, 2]
    assert read_chat_template(tiny_checkpoint).source == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert tokenizer.encode("<|im_start|>ferry<|im_end|>").ids[0] == 1
    text = "A ferry crosses the river."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    # 2 layers x K and V x 2 KV heads x head dim 16 x 4 bytes; 10^6 bytes hold 122 blocks of 16
    assert (runner.kv_bytes_per_token, runner.num_blocks, runner.block_size) == (512, 122, 16)
    assert runner.kv_cache.shape == (2, 2, 2, 122, 16, 16)
    bf16 = ModelRunner(tiny_checkpoint, num_blocks=3, block_size=8, dtype="bfloat16")
    assert (bf16.kv_bytes_per_token, bf16.num_blocks, bf16.kv_cache.dtype) == (256, 3, torch.bfloat16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float16"}, "dtype: expected one of ['bfloat16', 'float32'], got 'float16'"),
        ({"num_blocks": 4, "kv_memory_gb": 1.0}, "num_blocks and kv_memory_gb: give one or the other"),
        ({"num_blocks": 0}, "num_blocks: expected >= 1, got 0"),
        ({"kv_memory_gb": -1.0}, "kv_memory_gb: expected > 0, got -1.0"),
        ({"kv_memory_gb": 1e-9}, "kv_memory_gb: 1e-09 holds no block of 16 tokens"),
        ({"block_size": 0}, "block_size: expected >= 1, got 0"),
    ],
)
def test_runner_rejects_bad_settings(tiny_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelRunner(tiny_checkpoint, **kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": [0, 1, 64]}, r"batch.slot_mapping: expected slots in \[0, 32\)"),
        ({"block_tables": [[0]]}, "batch.block_tables\\[0\\]: 1 blocks cannot hold 5 tokens"),
        ({"block_tables": [[0, 8]]}, r"batch.block_tables\[0\]: expected block ids in \[0, 8\)"),
        ({"positions": [0, 1]}, "batch: 3 input ids, positions, slots and query_lens disagree"),
        ({"positions": [3, 4, 5]}, r"batch sequence 0: expected its last token at position .* = 4, got 5"),
    ],
)
def test_runner_rejects_a_batch_pointing_outside_its_cache(tiny_checkpoint, change, message):
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=8)
    fields = {
        "input_ids": [5, 6, 7],
        "positions": [2, 3, 4],
        "slot_mapping": [2, 3, 4],
        "query_lens": [3],
        "context_lens": [5],
        "block_tables": [[0, 1]],
        "samples": [Sample(GREEDY, 0)],
    }
    with pytest.raises(ValueError, match=message):
        runner.execute(ForwardBatch(**(fields | change)))


def test_bfloat16_stays_close_to_float32(tiny_checkpoint):
    prompt = [random.Random(4).randrange(3, 300) for _ in range(30)]
    table = [3, 0, 5, 1, 7, 2, 4, 6]
    batch = ForwardBatch(
        prompt,
        list(range(30)),
        [table[p // 4] * 4 + p % 4 for p in range(30)],
        [30],
        [30],
        [table],
        [Sample(GREEDY, 0)],
    )
    f32 = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=8).logits(batch)[0]
    bf16 = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=8, dtype="bfloat16").logits(batch)[0]
    assert bf16.dtype == torch.float32 and bf16.argmax() == f32.argmax()
    assert (bf16 - f32).abs().max() < 0.05 * f32.abs().max()


def test_rope_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (
        None,
        {"rope_type": "linear", "factor": 3.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ):
        fields = {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "rope_theta": 50000.0,
            "rope_scaling": scaling,
            "max_position_embeddings": 512,
        }
        expected = (
            ROPE_INIT_FUNCTIONS[scaling["rope_type"]](LlamaConfig(**fields), "cpu")[0]
            if scaling
            else 1.0 / 50000.0 ** (torch.arange(0, 64, 2).float() / 64)
        )
        torch.testing.assert_close(read_rope(fields).inv_freq(64), expected, rtol=0, atol=0)


def test_config_reads_both_rope_spellings_and_refuses_the_rest():
    older = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    newer = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    assert read_rope(older) == read_rope(newer) == Rope(theta=5e5, rope_type="linear", factor=2.0)
    assert read_rope({}) == Rope(theta=10000.0)
    with pytest.raises(ValueError, match=r"config.json rope type: expected one of .*, got 'yarn'"):
        read_rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    shape = {
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match=r"config.json attention_bias: biases are not supported"):
        LlamaConfig.from_dict(shape | {"attention_bias": True})
    with pytest.raises(ValueError, match="expected a llama model"):
        LlamaConfig.from_dict(shape | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(ValueError, match="num_key_value_heads: expected a divisor of 2 heads, got 3"):
        LlamaConfig.from_dict(shape | {"num_key_value_heads": 3})


def test_partition_pads_alike_sequences_together():
    # decodes with contexts of 1, 2, 2, 7 and 57, 63, 62 blocks of 16; prefill chunks of 200 and 3
    query_lens = [1, 1, 1, 1, 1, 1, 1, 200, 3]
    context_lens = [10, 30, 20, 100, 900, 1000, 980, 200, 3]
    assert partition(query_lens, context_lens, 16) == [[0, 1, 2, 3], [4, 5, 6], [8], [7]]
    assert partition([1] * 4, [16, 32, 48, 64], 16) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("device", DEVICES)
def test_groups_of_one_step_each_read_their_own_contexts(tiny_checkpoint, device):
    """Decodes of very different contexts and prefill chunks of very different sizes land in
    separate padded calls of one step, a whole prompt long enough alone and causal; each sampled
    row still equals the naive model (on the CPU and, where there is one, on CUDA)."""
    runner = ModelRunner(tiny_checkpoint, block_size=4, num_blocks=320, device=device)
    rng = random.Random(8)
    lengths = {"long": 601, "s1": 6, "s2": 8, "p": 20, "p2": 2, "whole": 70}
    tokens = {
        name: [rng.randrange(3, runner.config.vocab_size) for _ in range(n)] for name, n in lengths.items()
    }
    free = list(range(320))
    rng.shuffle(free)
    tables = {name: [free.pop() for _ in range(-(-n // 4))] for name, n in lengths.items()}

    def part(name, start, end, sample):
        table = tables[name]
        return (
            tokens[name][start:end],
            list(range(start, end)),
            [table[p // 4] * 4 + p % 4 for p in range(start, end)],
            end,
            table,
            sample,
        )

    def batch(parts):
        return ForwardBatch(
            [t for p in parts for t in p[0]],
            [t for p in parts for t in p[1]],
            [t for p in parts for t in p[2]],
            [len(p[0]) for p in parts],
            [p[3] for p in parts],
            [p[4] for p in parts],
            [Sample(GREEDY, 0) if p[5] else None for p in parts],
        )

    runner.execute(batch([part("long", 0, 300, False), part("s1", 0, 5, False), part("s2", 0, 7, False)]))
    runner.execute(batch([part("long", 300, 600, False)]))
    step = batch(
        [
            part("s1", 5, 6, True),
            part("p", 0, 20, True),
            part("long", 600, 601, True),
            part("whole", 0, 70, True),
            part("p2", 0, 2, True),
            part("s2", 7, 8, True),
        ]
    )
    plan = plan_attention(step, runner.cache_shape, torch.float32, runner.device)
    assert [g.num_seqs for g in plan.groups] == [2, 1, 2]  # s1 s2 | long | p p2 (p2 padded to 20 rows)
    assert plan.fresh == ((22, 70),)  # after s1's 1, p's 20 and long's 1 tokens
    logits = runner.logits(step).cpu()
    naive = NaiveLlama(tiny_checkpoint)
    for row, name in enumerate(["s1", "p", "long", "whole", "p2", "s2"]):
        torch.testing.assert_close(logits[row], naive.logits(tokens[name])[-1], atol=1e-4, rtol=1e-4)
