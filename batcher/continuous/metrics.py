"""What the continuous backend counts, and the ``/metrics`` families it becomes: what the
scheduler controls (KV blocks, preemptions, prefix-cache hits), named after vLLM's metrics.

The engines report their load in ``stats`` frames; the pool keeps each replica's last report,
adds the counters of the engines that died before it (a restart never sends a counter
backwards), and copies it all into a :class:`ContinuousCounters` at each snapshot, which
:func:`engine_families` turns into the ``ferry_engine_*`` families at scrape time (each with
its vLLM counterpart: docs/continuous.md, "Metrics"). The families every mode shares
(latencies, queue wait, restarts, ``ferry_queued_tokens``) are :mod:`batcher.core.metrics`';
no batch family has a continuous model's sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from batcher.continuous.handoff_phases import PHASES
from batcher.core.counters import Counters, Histogram
from batcher.core.mode import Exported
from workers.protocol import EngineStats

STEP_TOKEN_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
HANDOFF_BYTE_BOUNDS = tuple(float(1 << n) for n in range(16, 34, 2))  # 64 KiB .. 8 GiB
HANDOFF_SECOND_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica: its engine's last report (all zero while it has none), with the counters
    of the engines it lost added, so that they count since the pool started."""

    replica: int
    total_blocks: int
    generation_rate: float  # tokens generated per second, recently
    engine: EngineStats


@dataclasses.dataclass(slots=True)
class ContinuousCounters(Counters):
    """The pool's counters: the ones every mode keeps (queue wait, restarts, expired, cancelled,
    shed, unanswered) and the engines'."""

    reruns: int = 0  # jobs re-run on another replica, unseen by their client, after their engine died
    interrupted: int = 0  # streams ended with ReplicaLost
    resumed: int = 0  # streams that showed text, continued on another engine (on_engine_loss = "resume")
    step_tokens: Histogram = dataclasses.field(default_factory=lambda: Histogram(STEP_TOKEN_BOUNDS))
    handoff_bytes: Histogram = dataclasses.field(default_factory=lambda: Histogram(HANDOFF_BYTE_BOUNDS))
    handoff_seconds: Histogram = dataclasses.field(default_factory=lambda: Histogram(HANDOFF_SECOND_BOUNDS))
    handoff_phases: dict[str, Histogram] = dataclasses.field(  # the pause's parts, by PHASES
        default_factory=lambda: {phase: Histogram(HANDOFF_SECOND_BOUNDS) for phase in PHASES})
    replicas: tuple[ReplicaStats, ...] = ()


_GAUGES = (
    ("ferry_engine_running_sequences", "Sequences the engine runs (vllm:num_requests_running).", "running"),
    ("ferry_engine_waiting_sequences", "Sequences the engine holds but has not scheduled.", "waiting"),
    ("ferry_engine_kv_blocks_free", "Free KV cache blocks, cached prefixes included.", "free_blocks"),
    ("ferry_engine_kv_blocks_used", "KV cache blocks held by sequences.", "used_blocks"),
)
_COUNTERS = (
    ("ferry_engine_preemptions", "Sequences preempted by recompute.", "preemptions"),
    ("ferry_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    ("ferry_engine_prefix_cache_hits", "Prompt tokens the prefix cache supplied.", "prefix_hits"),
    ("ferry_engine_generated_tokens", "Tokens generated.", "generated_tokens"),
)


def engine_families(backends: Sequence[Exported[ContinuousCounters]]) -> Iterator[Metric]:
    """The continuous families of every continuous backend, from its :class:`ContinuousCounters`."""
    by_replica = ["model", "replica"]
    gauges = [(GaugeMetricFamily(name, text, labels=by_replica), field) for name, text, field in _GAUGES]
    counters = [
        (CounterMetricFamily(name, text, labels=by_replica), field) for name, text, field in _COUNTERS
    ]
    rate = GaugeMetricFamily("ferry_engine_generation_tokens_per_second",
                             "Tokens generated per second, recently.", labels=by_replica)
    steps = HistogramMetricFamily(
        "ferry_engine_step_tokens", "Tokens computed per engine step.", labels=["model"]
    )
    reruns = CounterMetricFamily("ferry_engine_reruns", "Jobs re-run unseen after their engine died.",
                                 labels=["model"])
    interrupted = CounterMetricFamily("ferry_engine_interrupted_streams",
                                      "Streams ended by an error after sending text.", labels=["model"])
    resumed = CounterMetricFamily("ferry_engine_resumed_streams",
                                  "Streams continued on another engine after theirs died.", labels=["model"])
    moved = HistogramMetricFamily("ferry_engine_kv_handoff_bytes",
                                  "KV bytes moved per prefill -> decode hand-off.", labels=["model"])
    paused = HistogramMetricFamily(
        "ferry_engine_kv_handoff_seconds",
        "Per hand-off: from its KV leaving the prefill replica to the decode replica's next token.",
        labels=["model"])
    parts = HistogramMetricFamily(
        "ferry_engine_kv_handoff_phase_seconds",
        "Per hand-off, each part of its pause and of its export (docs/continuous.md).",
        labels=["model", "phase"])
    families: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [*gauges, *counters]
    for model, _, snapshot in backends:
        counted: ContinuousCounters = snapshot.counters
        for replica in counted.replicas:
            labels = [model, str(replica.replica)]
            for family, field in families:
                family.add_metric(labels, getattr(replica.engine, field))
            rate.add_metric(labels, replica.generation_rate)
        steps.add_metric([model], counted.step_tokens.cumulative(), counted.step_tokens.total)
        moved.add_metric([model], counted.handoff_bytes.cumulative(), counted.handoff_bytes.total)
        paused.add_metric([model], counted.handoff_seconds.cumulative(), counted.handoff_seconds.total)
        for phase, part in counted.handoff_phases.items():
            parts.add_metric([model, phase], part.cumulative(), part.total)
        reruns.add_metric([model], counted.reruns)
        interrupted.add_metric([model], counted.interrupted)
        resumed.add_metric([model], counted.resumed)
    yield from (family for family, _ in families)
    yield from (rate, steps, reruns, interrupted, resumed, moved, paused, parts)
