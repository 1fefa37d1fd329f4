"""What the continuous-mode experiments share: one replica's engine alone in virtual time.

:class:`Replica` is the production :class:`~workers.engine.engine.Engine` (scheduler, block
manager, prefix cache) over a :class:`~workers.engine.simulated.SimulatedRunner` priced by the
cost model, stepped by hand: each step advances the replica's clock by the step's price. The
experiments that need the pool and the router replay workloads through
:func:`batcher.sim.continuous.replay.replay` instead; :func:`pool_replay` does it for a fleet of
replicas of one cost model.
"""

from __future__ import annotations

import dataclasses

from batcher.continuous.config import ContinuousModelConfig
from batcher.core.config import QueueConfig
from batcher.sim.continuous.engine import EngineSpec
from batcher.sim.continuous.replay import Replayed, replay
from batcher.sim.continuous.workload import Workload
from experiments.common import plt  # pyplot with the files-only backend
from workers.engine.config import EngineConfig
from workers.engine.cost_model import A100, PRESETS, CostModel
from workers.engine.engine import Engine
from workers.engine.interface import StepOutput
from workers.engine.simulated import SimulatedRunner
from workers.sampling import Sampling

SEVENTY_B = PRESETS["llama-70b"]  # on 8 x H100
KV_BLOCKS_70B = 400 * 10**9 // (SEVENTY_B.shape.kv_bytes_per_token * 16)  # 400 GB of KV in blocks of 16
SMALL_70B = CostModel(SEVENTY_B.shape, dataclasses.replace(A100, gpus=4))
"""70B on 4 x A100: a replica ~7x slower than 8 x H100, so minutes of its traffic replay in seconds."""
KV_BLOCKS_SMALL_70B = 180 * 10**9 // (SEVENTY_B.shape.kv_bytes_per_token * 16)  # 320 GB less the weights


def pool_replay(
    workload: Workload,
    queue: QueueConfig,
    *,
    workers: int = 1,
    cost: CostModel = SEVENTY_B,
    num_blocks: int = KV_BLOCKS_70B,
    sample_every: float = 1.0,
) -> Replayed:
    """``workload`` through the production pool, router and admission over ``workers`` replicas
    priced by ``cost`` (chunked prefill at 2,048 tokens a step, 256 sequences at most)."""
    model = ContinuousModelConfig(
        name="sim@1", simulated="llama-70b", workers=workers, num_blocks=num_blocks, max_batch_tokens=2048
    )
    return replay(workload, model, queue, EngineSpec.of(model, cost), sample_every=sample_every)


class Replica:
    """One engine and its virtual clock (seconds since it started)."""

    def __init__(
        self,
        cost: CostModel = SEVENTY_B,
        *,
        num_blocks: int = KV_BLOCKS_70B,
        max_batch_tokens: int = 2048,
        max_seqs: int = 256,
    ) -> None:
        self.now = 0.0
        self.runner = SimulatedRunner(cost, num_blocks=num_blocks)
        config = EngineConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs)
        self.engine = Engine(self.runner, config, clock=lambda: self.now)
        self._prompts = 0

    def add(self, prompt: list[int] | int, answer: int, tenant: str = "") -> int:
        """Queue a sequence of ``prompt`` ids (or that many fresh ones) asking ``answer`` tokens."""
        if isinstance(prompt, int):
            self._prompts += 1
            prompt = [3 + (self._prompts * 7_919 + i * 31) % 100_000 for i in range(prompt)]
        return self.engine.add(prompt, Sampling(max_tokens=answer), tenant=tenant)

    def step(self) -> tuple[StepOutput, float]:
        """One step, and the seconds it took (0 if nothing ran)."""
        steps = self.engine.steps
        output = self.engine.step()
        seconds = self.runner.last_step_seconds if self.engine.steps > steps else 0.0
        self.now += seconds
        return output, seconds

    def decoding(self) -> bool:
        """Every sequence has its prompt computed (the next step is decodes only)."""
        return all(s.num_computed >= s.num_prompt for s in self.engine.scheduler.sequences.values())


def two_scales(
    x: list,
    left: list,
    right: list,
    *,
    xlabel: str,
    left_label: str,
    right_label: str,
    title: str,
    bars: bool = False,
    log: bool = False,
) -> plt.Figure:
    """One figure, two y axes: ``left`` (bars, or a line) in blue and ``right`` (a line) in red."""
    figure, axis = plt.subplots(figsize=(7, 4))
    if bars:
        axis.bar(x, left, color="tab:blue")
    else:
        axis.plot(x, left, "o-", color="tab:blue")
    if log:
        axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(left_label, color="tab:blue")
    other = axis.twinx()
    other.plot(x, right, "s--", color="tab:red")
    other.set_ylabel(right_label, color="tab:red")
    axis.set_title(title)
    return figure
