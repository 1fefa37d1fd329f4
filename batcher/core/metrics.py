"""The core's metric families: what the modes count, exported at ``/metrics``.

Every mode shares queue wait by tier, worker restarts, unanswered requests, queued work in its
own unit (``ferry_queued_requests``, ``ferry_queued_tokens``) and estimated wait; each mode adds
its own families through its registry entry (:mod:`batcher.core.modes`). The core counts in
plain records without locks; at each scrape the bridge asks every backend for a
:class:`~batcher.core.backend.Snapshot`, taken on the trio thread, and :class:`CoreCollector`
turns them into families, so the scheduler's hot path pays nothing for being observed. The
gateway's families and the registry are :mod:`gateway.metrics`'. Labels are model and tier
names and reasons: never an API key or prompt text.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from batcher.core.backend import Snapshot
from batcher.core.counters import Counters
from batcher.core.mode import Exported
from batcher.core.modes import serving


@dataclasses.dataclass(frozen=True, slots=True)
class _Backend:
    model: str
    tiers: list[str]


ROLES = ("starting", "warm", "serving", "draining")
"""The states ``ferry_workers`` counts: a worker taking work (idle, busy, hung...) is serving."""


def _role(state: str) -> str:
    return state if state in ROLES else "serving"


_SHARED_COUNTERS = (
    ("ferry_worker_restarts", "Workers killed (crash, hang, protocol fault) and restarted.", "restarts"),
    ("ferry_unanswered_requests", "Dispatched requests no worker answered in time (500).", "timed_out"),
)


class CoreCollector(Collector):
    """Every tracked backend's families, one family per name, a sample per model (and tier):
    first the ones every mode shares, then each mode's own, from that mode's registry entry.
    Queued work is one family per unit (``ferry_queued_requests``, ``ferry_queued_tokens``), so
    no family adds requests to tokens; a family no backend has a sample for is left out."""

    def __init__(self) -> None:
        self.backends: list[_Backend] = []
        self.snapshots: Mapping[str, Snapshot[Counters]] = {}

    def track(self, model: str, tiers: Sequence[str]) -> None:
        """Export one backend's core counters, from its snapshot at each scrape."""
        self.backends.append(_Backend(model, list(tiers)))

    def untrack(self, model: str) -> None:
        """A version's backend has stopped: its core counters leave the export."""
        self.backends = [backend for backend in self.backends if backend.model != model]

    def collect(self) -> Iterator:
        families = [(CounterMetricFamily(name, text, labels=["model"]), field)
                    for name, text, field in _SHARED_COUNTERS]
        wait = HistogramMetricFamily(
            "ferry_queue_wait_seconds", "Arrival to dispatch.", labels=["model", "tier"]
        )
        queued: dict[str, GaugeMetricFamily] = {}
        estimate = GaugeMetricFamily(
            "ferry_estimated_wait_seconds", "Estimated wait of a new request.", labels=["model", "tier"]
        )
        workers = GaugeMetricFamily(
            "ferry_workers", "Worker slots by state: starting, warm, serving, draining.",
            labels=["model", "state"],
        )
        scale_events = CounterMetricFamily(
            "ferry_scale_events", "Decisions of a scaler that moved, by direction and cause.",
            labels=["model", "direction", "cause"],
        )
        placement = GaugeMetricFamily(
            "ferry_worker_placement",
            "1 per worker slot, labelled with where its worker runs (local, or ray:node).",
            labels=["model", "slot", "placement"],
        )
        by_mode: dict[str, list[Exported[Counters]]] = {}
        for backend in self.backends:
            snapshot = self.snapshots.get(backend.model)
            if snapshot is None:
                continue
            model, counters, load = backend.model, snapshot.counters, snapshot.load
            unit = snapshot.status.unit
            by_mode.setdefault(snapshot.mode, []).append(Exported(model, backend.tiers, snapshot))
            for family, field in families:
                family.add_metric([model], getattr(counters, field))
            for index, histogram in sorted(counters.queue_wait.items()):
                wait.add_metric([model, backend.tiers[index]], histogram.cumulative(), histogram.total)
            if unit not in queued:
                text = f"{unit.capitalize()} waiting in the queues."
                queued[unit] = GaugeMetricFamily(f"ferry_queued_{unit}", text, labels=["model", "tier"])
            for index, tier in enumerate(backend.tiers):
                queued[unit].add_metric([model, tier], load.queued[index])
                estimate.add_metric([model, tier], load.wait(index))
            for worker in snapshot.status.workers:
                placement.add_metric([model, str(worker.slot), worker.placement], 1)
            states = collections.Counter(_role(worker.state) for worker in snapshot.status.workers)
            for state in ROLES:
                workers.add_metric([model, state], states[state])
            for (direction, cause), count in sorted(counters.scale_events.items()):
                scale_events.add_metric([model, direction, cause], count)
        yield from (family for family, _ in families)
        yield from (wait, *queued.values(), estimate, workers, scale_events, placement)
        for mode, exported in by_mode.items():
            yield from serving(mode).families(exported)
