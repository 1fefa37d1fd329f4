"""The one metrics registry: the gateway's families beside the core's, at ``/metrics``.

The gateway sees each request end: requests by status, TTFT, time per output token, end-to-end
latency, admission rejects by reason, safety blocks, requests by alias. It observes them
directly (prometheus_client is thread-safe), once per request. The core's families (batches,
workers, queues, engines) come from :class:`batcher.core.metrics.CoreCollector`, registered here,
which reads the backends' snapshots at each scrape.

Labels are model and tier names, statuses and reasons: never an API key or prompt text. The
``ferry_tenant_*`` families name a tenant only if the config does (its ``[[keys]]``, the first
:data:`NAMED_TENANTS` of them); every other tenant is counted as ``other``, so a label's values
stay as few as the config's tenants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batcher.core.admission import Rate
from batcher.core.backend import Snapshot
from batcher.core.cost import cost_per_million_tokens
from batcher.core.counters import Counters
from batcher.core.metrics import CoreCollector

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
NAMED_TENANTS = 200
"""The most tenants the per-tenant families name; the rest, and any not in the config, are ``other``."""
OTHER = "other"
TOKEN_RATE_TAU = 60.0
"""Seconds over which the tokens/s behind ``ferry_cost_per_million_tokens`` is averaged."""


class Metrics:
    """Every ferry_* family, in one registry of its own (tests can run several side by side)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        by_tier = ["model", "tier"]
        self.requests = Counter(
            "ferry_requests",
            "Requests answered, by HTTP status.",
            [*by_tier, "status"],
            registry=self.registry,
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
            "Requests refused, by reason: rate_limit (429), shed (529 at admission), "
            "expired (529 in the queue).",
            [*by_tier, "reason"],
            registry=self.registry,
        )
        self.safety_blocks = Counter(
            "ferry_safety_blocks",
            "Inputs refused or outputs replaced by the safety stage.",
            ["model", "stage"],
            registry=self.registry,
        )
        self.alias_requests = Counter(
            "ferry_alias_requests", "Requests that named an alias, by the version that took them.",
            ["alias", "model"], registry=self.registry,
        )
        by_tenant = ["model", "tenant"]
        self.tenant_requests = Counter(
            "ferry_tenant_requests", "Requests by tenant and outcome (completed, shed, expired, "
            "rate_limited, failed, interrupted, cancelled).", [*by_tenant, "outcome"], registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "ferry_tenant_tokens", "Tokens by tenant: input (the prompts) and output (delivered).",
            [*by_tenant, "kind"], registry=self.registry,
        )
        self.tenant_ttft = Histogram(
            "ferry_tenant_ttft_seconds", "Time to first token by tenant.", by_tenant,
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.named: frozenset[str] = frozenset()
        self.cost = Gauge(
            "ferry_cost_per_million_tokens", "What a million tokens (prompt and answer, as billed) cost "
            "at the recent rate: gpu_hour_price x GPUs of the workers up / tokens per second.", ["model"],
            registry=self.registry,
        )
        self._prices: dict[str, float] = {}  # model -> its worker_hour_price, for those priced
        self._token_rates: dict[str, Rate] = {}
        self._costed: set[str] = set()  # models whose cost is exported now
        self._alias_series: dict[tuple[str, str], Counter] = {}  # a labelled child
        self._core = CoreCollector()
        self.registry.register(self._core)

    def name_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants the per-tenant families name from now on (the config's, in its order)."""
        self.named = frozenset(list(dict.fromkeys(tenants))[:NAMED_TENANTS])

    def tenant(self, name: str) -> str:
        """The ``tenant`` label of a request of tenant ``name``."""
        return name if name in self.named else OTHER

    def count_alias(self, alias: str, model: str) -> None:
        """One request that named ``alias`` taken by version ``model`` (a configured pair, so
        the series are few): each series looked up once, not on every request."""
        series = self._alias_series.get((alias, model))
        if series is None:
            series = self._alias_series[alias, model] = self.alias_requests.labels(alias, model)
        series.inc()

    def track(self, model: str, tiers: Sequence[str], worker_hour_price: float = 0.0) -> None:
        """Export one backend's core counters, from its snapshot at each scrape, and what its
        tokens cost if its workers are priced."""
        self._core.track(model, tiers)
        if worker_hour_price > 0:
            self._prices[model] = worker_hour_price
            self._token_rates[model] = Rate(TOKEN_RATE_TAU)

    def untrack(self, model: str) -> None:
        """A version's backend has stopped: its core counters leave the export."""
        self._core.untrack(model)
        if self._prices.pop(model, None) is not None:
            del self._token_rates[model]
        if model in self._costed:
            self._costed.discard(model)
            self.cost.remove(model)

    def count_tokens(self, model: str, tokens: int) -> None:
        """Tokens a model answered (billed): the rate its cost is divided by."""
        rate = self._token_rates.get(model)
        if rate is not None:
            rate.add(self._clock(), tokens)

    def _set_costs(self, snapshots: Mapping[str, Snapshot[Counters]]) -> None:
        """Each priced model's cost at its recent token rate; none while it answers no token."""
        now = self._clock()
        for model, price in self._prices.items():
            snapshot = snapshots.get(model)
            workers = sum(w.up for w in snapshot.status.workers) if snapshot is not None else 0
            cost = cost_per_million_tokens(price, workers, self._token_rates[model].at(now))
            if not math.isnan(cost):
                self.cost.labels(model).set(cost)
                self._costed.add(model)
            elif model in self._costed:
                self._costed.discard(model)
                self.cost.remove(model)

    def exposition(self, snapshots: Mapping[str, Snapshot[Counters]] | None = None) -> bytes:
        """The Prometheus text format of every family; the core's from these snapshots."""
        self._core.snapshots = snapshots or {}
        self._set_costs(snapshots or {})
        try:
            return generate_latest(self.registry)
        finally:
            self._core.snapshots = {}
