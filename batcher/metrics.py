"""The one metrics registry: what both batching modes and the gateway export at ``/metrics``.

Two kinds of families, by who sees the event (DESIGN §9, seed 000 §6.5):

- The gateway sees each request end: requests by status, TTFT, time per output token,
  end-to-end latency, admission rejects by reason, safety blocks. It observes them directly
  (prometheus_client is thread-safe), once per request.
- The core sees batches and workers: flushes by reason, batch sizes, queue wait by tier, worker
  restarts, batch retries, bisections, queued work and estimated wait. It already counts them in
  its plain :class:`~batcher.stats.Stats` without locks; at each scrape the bridge asks every
  backend for a :class:`~batcher.backend.Snapshot` (taken on the trio thread) and a collector
  turns those into families, so the scheduler's hot path pays nothing for being observed.

Labels are model and tier names, statuses and reasons: never an API key or prompt text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from batcher.backend import Snapshot
from batcher.engine_metrics import engine_families

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """Every ferry_* family, in one registry of its own (tests can run several side by side)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        by_tier = ["model", "tier"]
        self.requests = Counter(
            "ferry_requests", "Requests answered, by HTTP status.", [*by_tier, "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "ferry_ttft_seconds", "Time to first token: arrival to the first text sent.", by_tier,
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "ferry_time_per_output_token_seconds", "Time between output tokens after the first.", by_tier,
            buckets=TOKEN_BUCKETS, registry=self.registry,
        )
        self.latency = Histogram(
            "ferry_request_latency_seconds", "End-to-end latency: arrival to the last byte.", by_tier,
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.admission_rejects = Counter(
            "ferry_admission_rejects",
            "Requests refused, by reason: rate_limit (429), shed (529 at admission), expired (529 in the queue).",
            [*by_tier, "reason"], registry=self.registry,
        )
        self.safety_blocks = Counter(
            "ferry_safety_blocks", "Inputs refused or outputs replaced by the safety stage.", ["model", "stage"],
            registry=self.registry,
        )
        self.alias_requests = Counter(
            "ferry_alias_requests", "Requests that named an alias, by the version that took them.",
            ["alias", "model"], registry=self.registry,
        )
        self._alias_series: dict[tuple[str, str], Counter] = {}  # a labelled child
        self._core = _CoreCollector()
        self.registry.register(self._core)

    def count_alias(self, alias: str, model: str) -> None:
        """One request that named ``alias`` taken by version ``model`` (a configured pair, so
        the series are few): each series looked up once, not on every request."""
        series = self._alias_series.get((alias, model))
        if series is None:
            series = self._alias_series[alias, model] = self.alias_requests.labels(alias, model)
        series.inc()

    def track(self, model: str, tiers: Sequence[str]) -> None:
        """Export one backend's core counters, from its snapshot at each scrape."""
        self._core.backends.append(_Backend(model, list(tiers)))

    def untrack(self, model: str) -> None:
        """A version's backend has stopped: its core counters leave the export."""
        self._core.backends = [backend for backend in self._core.backends if backend.model != model]

    def exposition(self, snapshots: Mapping[str, Snapshot] | None = None) -> bytes:
        """The Prometheus text format of every family; the core's from these snapshots."""
        self._core.snapshots = snapshots or {}
        try:
            return generate_latest(self.registry)
        finally:
            self._core.snapshots = {}


@dataclasses.dataclass(frozen=True, slots=True)
class _Backend:
    model: str
    tiers: list[str]


class _CoreCollector(Collector):
    """Every tracked backend's counters, one family per name, a sample per model (and tier)."""

    def __init__(self) -> None:
        self.backends: list[_Backend] = []
        self.snapshots: Mapping[str, Snapshot] = {}

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
        placement = GaugeMetricFamily(
            "ferry_worker_placement", "1 per worker slot, labelled with where its worker runs (local, or ray:node).",
            labels=["model", "slot", "placement"],
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
            for worker in snapshot.status.get("workers", ()):
                placement.add_metric([model, str(worker["slot"]), worker["placement"]], 1)
        yield flushes
        yield from (family for family, _ in counters)
        yield from (sizes, wait, queued, estimate, placement)
        yield from engine_families(
            [(b.model, self.snapshots[b.model].stats) for b in self.backends if b.model in self.snapshots]
        )
