"""The core's metric families: what the batching modes count, exported at ``/metrics``.

The core sees batches and workers: flushes by reason, batch sizes, queue wait by tier, worker
restarts, batch retries, bisections, queued work and estimated wait, and the engines' families
(:mod:`batcher.engine_metrics`). It already counts them in its plain
:class:`~batcher.stats.Stats` without locks; at each scrape the bridge asks every backend for a
:class:`~batcher.backend.Snapshot` (taken on the trio thread) and :class:`CoreCollector` turns
those into families, so the scheduler's hot path pays nothing for being observed. The gateway's
own families (requests, latencies, rejects) and the registry they share are
:mod:`gateway.metrics`'s.

Labels are model and tier names and reasons: never an API key or prompt text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from batcher.backend import Snapshot
from batcher.engine_metrics import engine_families


@dataclasses.dataclass(frozen=True, slots=True)
class _Backend:
    model: str
    tiers: list[str]


class CoreCollector(Collector):
    """Every tracked backend's counters, one family per name, a sample per model (and tier),
    from the snapshots set in :attr:`snapshots` for the scrape."""

    def __init__(self) -> None:
        self.backends: list[_Backend] = []
        self.snapshots: Mapping[str, Snapshot] = {}

    def track(self, model: str, tiers: Sequence[str]) -> None:
        """Export one backend's core counters, from its snapshot at each scrape."""
        self.backends.append(_Backend(model, list(tiers)))

    def untrack(self, model: str) -> None:
        """A version's backend has stopped: its core counters leave the export."""
        self.backends = [backend for backend in self.backends if backend.model != model]

    def collect(self) -> Iterator:
        flushes = CounterMetricFamily("ferry_flushes", "Batches flushed, by reason.", labels=["model", "reason"])
        counters = [
            (CounterMetricFamily(name, help_text, labels=["model"]), field)
            for name, help_text, field in (
                ("ferry_worker_restarts", "Workers killed (crash, hang, protocol fault) and restarted.", "restarts"),
                ("ferry_batch_retries", "Batches re-dispatched whole after a failed call.", "retries"),
                ("ferry_bisections", "Failed batches split in two to isolate a bad input.", "bisections"),
                ("ferry_unanswered_requests", "Dispatched requests no worker answered in time (500).", "timed_out"),
            )
        ]
        sizes = HistogramMetricFamily("ferry_batch_size", "Requests per flushed batch.", labels=["model"])
        wait = HistogramMetricFamily("ferry_queue_wait_seconds", "Arrival to dispatch.", labels=["model", "tier"])
        queued = GaugeMetricFamily("ferry_queued_work", "Work waiting in the queues.", labels=["model", "tier"])
        estimate = GaugeMetricFamily(
            "ferry_estimated_wait_seconds", "Estimated wait of a new request.", labels=["model", "tier"]
        )
        for backend in self.backends:
            snapshot = self.snapshots.get(backend.model)
            if snapshot is None:
                continue
            model, stats, load = backend.model, snapshot.stats, snapshot.load
            for reason, count in sorted(stats.flushes.items()):
                flushes.add_metric([model, reason], count)
            for family, field in counters:
                family.add_metric([model], getattr(stats, field))
            sizes.add_metric([model], stats.batch_sizes.cumulative(), stats.batch_sizes.total)
            for index, histogram in sorted(stats.queue_wait.items()):
                wait.add_metric([model, backend.tiers[index]], histogram.cumulative(), histogram.total)
            for index, tier in enumerate(backend.tiers):
                queued.add_metric([model, tier], load.queued[index])
                estimate.add_metric([model, tier], load.wait(index))
        yield flushes
        yield from (family for family, _ in counters)
        yield from (sizes, wait, queued, estimate)
        yield from engine_families(
            [(b.model, self.snapshots[b.model].stats) for b in self.backends if b.model in self.snapshots]
        )
