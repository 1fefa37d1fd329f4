"""The cost model against the textbook arithmetic of a 70B model on 8 x H100, and the simulated runner it
prices: deterministic tokens that ignore batch mates and preemptions, EOS only when asked."""

from __future__ import annotations

import dataclasses

import pytest

from workers.engine.batch import BatchRunner, ForwardBatch, Sample
from workers.engine.config import EngineConfig
from workers.engine.cost_model import H100, LLAMA_70B, PRESETS, SMOLLM2_135M, CostModel
from workers.engine.engine import Engine
from workers.engine.sequence import FinishReason
from workers.engine.simulated import SimulatedRunner
from workers.sampling import Sampling

SEVENTY_B = PRESETS["llama-70b"]  # on 8 x H100


def test_kv_bytes_per_token_and_what_fits_the_70b_replica():
    assert LLAMA_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # K and V, per layer and KV head
    assert 2_000 * LLAMA_70B.kv_bytes_per_token == 655_360_000  # "about 650 MB" a conversation
    tokens = 400 * 10**9 // LLAMA_70B.kv_bytes_per_token
    assert (tokens, tokens // 2_000) == (1_220_703, 610)  # 400 GB of KV: 1.22 M tokens, ~610 sequences
    assert LLAMA_70B.weight_bytes == 140 * 10**9


def test_a_decode_step_of_the_70b_reads_its_weights_in_5_2_ms_and_batching_multiplies_throughput():
    alone = SEVENTY_B.step([1], [1])
    assert alone.memory_seconds == (140e9 + 327_680) / (8 * 3.35e12)
    assert alone.seconds == alone.memory_seconds == pytest.approx(5.224e-3, rel=1e-3)  # ~5.2 ms
    assert 1 / alone.seconds == pytest.approx(191.4, rel=1e-3)  # "about 190 tokens a second"
    batch = SEVENTY_B.step([1] * 256, [2_000] * 256)
    kv_read = 256 * 2_000 * 327_680
    assert kv_read == 167_772_160_000  # "≈ 168 GB"
    assert (
        batch.memory_seconds == (140e9 + kv_read) / 26.8e12 == pytest.approx(11.484e-3, rel=1e-3)
    )  # ~11.5 ms
    assert batch.compute_seconds < batch.memory_seconds  # decode is bandwidth-bound
    assert 256 / batch.seconds == pytest.approx(22_292, rel=1e-3)  # "≈ 22,000 tokens a second"
    assert (256 / batch.seconds) / (1 / alone.seconds) == pytest.approx(116.5, rel=1e-3)  # "117 times"


def test_a_long_prefill_is_compute_bound_at_two_flops_per_parameter_per_token():
    cost = SEVENTY_B.step([8_700], [8_700])  # recomputing 8,700 tokens of history
    linear = 2 * 70e9 * 8_700
    assert linear == pytest.approx(1.218e15)  # "about 1.2 x 10^15 operations"
    attention = SEVENTY_B.attention_flops(8_700, 8_700)
    assert attention == 4 * 80 * 64 * 128 * (8_700 * 8_700 - 8_700 * 8_699 // 2)
    assert cost.compute_seconds == (linear + attention) / (8 * 989e12)
    assert cost.seconds == cost.compute_seconds > cost.memory_seconds  # the roofline's other side
    gpus = 2 * LLAMA_70B.params * 750_000 / (0.5 * H100.flops)  # prefill of 750k tokens/s at 50 % utilisation
    assert gpus == pytest.approx(212.3, rel=1e-3)


def test_attention_counts_each_query_against_every_earlier_key_of_its_sequence():
    model = CostModel(SMOLLM2_135M, H100)
    per_pair = 4 * 30 * 9 * 64
    assert model.attention_flops(1, 10) == 10 * per_pair  # a decode reads 10 keys
    assert model.attention_flops(3, 5) == (3 + 4 + 5) * per_pair  # positions 2, 3, 4
    assert model.attention_flops(4, 4) == (1 + 2 + 3 + 4) * per_pair


def test_the_smollm2_shape_gives_its_parameter_count_and_kv_size():
    assert SMOLLM2_135M.params == 134_515_008  # 134.5 M parameters
    assert SMOLLM2_135M.weight_bytes == 269_030_016  # its 269 MB bf16 safetensors
    assert SMOLLM2_135M.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    as_shaped = dataclasses.replace(LLAMA_70B, stated_params=None)  # untied: embeddings and head apart
    assert as_shaped.params == 70_553_706_496  # Llama 3 70B's count; capacity arithmetic rounds it to 70B


def test_a_step_costs_the_larger_of_its_memory_and_compute_times_not_their_sum():
    model = PRESETS["smollm2-135m"]
    mixed = model.step([1] * 64 + [448], [300] * 64 + [448])
    assert mixed.seconds == max(mixed.memory_seconds, mixed.compute_seconds)
    assert mixed.seconds < mixed.memory_seconds + mixed.compute_seconds


def batch_of(*sequences: tuple[list[int], int, Sample | None]) -> ForwardBatch:
    """A batch of whole prompts: (tokens, first position, sample) per sequence."""
    ids, positions, qlens, clens, samples = [], [], [], [], []
    for tokens, start, sample in sequences:
        ids += tokens
        positions += range(start, start + len(tokens))
        qlens.append(len(tokens))
        clens.append(start + len(tokens))
        samples.append(sample)
    return ForwardBatch(ids, positions, list(range(len(ids))), qlens, clens, [[0]] * len(qlens), samples)


def test_the_simulated_runner_records_each_step_s_price_and_waits_it_out_when_asked():
    waited = []
    runner = SimulatedRunner(PRESETS["smollm2-135m"], num_blocks=64, wait=waited.append)
    greedy = Sample(Sampling(), 0)
    batch = batch_of(([5, 6, 7], 0, greedy), ([9] * 20, 0, None), ([4], 30, greedy))
    tokens = runner.execute(batch)
    assert tokens[1] is None and all(isinstance(t, int) for t in (tokens[0], tokens[2]))
    expected = PRESETS["smollm2-135m"].step([3, 20, 1], [3, 20, 31]).seconds
    assert runner.last_step_seconds == expected and waited == [expected]
    assert SimulatedRunner(PRESETS["smollm2-135m"], num_blocks=64).execute(batch) == tokens  # deterministic
    runner.execute(batch)
    assert runner.total_seconds == 2 * expected


def test_the_simulated_runner_sizes_its_cache_from_blocks_or_memory():
    smol = PRESETS["smollm2-135m"]
    assert SimulatedRunner(smol, kv_memory_gb=1.0).num_blocks == 2**30 // (23_040 * 16) == 2_912
    assert SimulatedRunner(smol, block_size=32, num_blocks=10).num_blocks == 10
    assert SimulatedRunner(smol).num_blocks == 1024
    with pytest.raises(ValueError, match="give num_blocks or kv_memory_gb, not both"):
        SimulatedRunner(smol, num_blocks=10, kv_memory_gb=1.0)
    with pytest.raises(ValueError, match=r"eos_prob: expected a probability in \[0, 1\], got 1.5"):
        SimulatedRunner(smol, eos_prob=1.5)


def run_all(
    runner: SimulatedRunner, prompts: list[list[int]], sampling: Sampling, num_blocks: int, **config
):
    engine = Engine(runner, EngineConfig(num_blocks=num_blocks, watermark=0.0, **config))
    rids = [engine.add(prompt, sampling) for prompt in prompts]
    outputs: dict[int, list[int]] = {rid: [] for rid in rids}
    reasons = {}
    while engine.has_work:
        output = engine.step()
        for rid, token in output.tokens.items():
            outputs[rid].append(token)
        reasons.update((done.rid, done.reason) for done in output.finished)
    return [outputs[rid] for rid in rids], [reasons[rid] for rid in rids], engine.stats()


def test_simulated_answers_ignore_batch_mates_and_preemptions_and_never_end_unasked():
    smol = PRESETS["smollm2-135m"]
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + 13 * i)] for i in range(12)]
    sampling = Sampling(max_tokens=60, temperature=0.8, seed=11)
    alone = [run_all(SimulatedRunner(smol, num_blocks=512), [p], sampling, 512)[0][0] for p in prompts]
    together, reasons, stats = run_all(
        SimulatedRunner(smol, num_blocks=24), prompts, sampling, 24, max_batch_tokens=64, max_seqs=8
    )
    assert together == alone and stats.preemptions > 0
    assert reasons == [FinishReason.MAX_TOKENS] * 12 and all(2 not in answer for answer in alone)


class BatchedRunner(SimulatedRunner):
    """The simulated runner that lays each step's batch out, as a model's runner does."""

    run = BatchRunner.run


def test_a_schedule_read_directly_gives_the_tokens_and_prices_of_its_laid_out_batch():
    smol = PRESETS["smollm2-135m"]
    prompts = [[(5 * i + j) % 400 + 3 for j in range(30 + 41 * i)] for i in range(10)]
    sampling = Sampling(max_tokens=40, temperature=0.7, seed=5)
    runs = []
    for kind in (SimulatedRunner, BatchedRunner):  # chunked prompts, preemptions and recomputes
        runner = kind(smol, num_blocks=30, eos_prob=0.02)
        answers = run_all(runner, prompts, sampling, 30, max_batch_tokens=48, max_seqs=6)
        runs.append((answers, runner.total_seconds))
    (direct, direct_seconds), (batched, batched_seconds) = runs
    assert direct == batched and direct_seconds == batched_seconds and direct[2].preemptions > 0
    assert FinishReason.EOS in direct[1]


def test_the_simulated_runner_ends_answers_with_eos_at_the_asked_rate():
    smol = PRESETS["smollm2-135m"]
    prompts = [[i + 3] * 5 for i in range(200)]
    always, reasons, _ = run_all(
        SimulatedRunner(smol, eos_prob=1.0, num_blocks=512), prompts[:3], Sampling(), 512
    )
    assert always == [[2]] * 3 and reasons == [FinishReason.EOS] * 3
    answers, reasons, _ = run_all(
        SimulatedRunner(smol, eos_prob=0.1, num_blocks=512), prompts, Sampling(max_tokens=100), 512
    )
    ended = [answer for answer, reason in zip(answers, reasons, strict=False) if reason is FinishReason.EOS]
    assert all(answer[-1] == 2 and 2 not in answer[:-1] for answer in ended)
    assert len(ended) == 200 and 8 < sum(map(len, ended)) / 200 < 12  # geometric: a mean of 1 / 0.1
