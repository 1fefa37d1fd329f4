"""The metrics registry: every family parses with prometheus_client's own parser."""

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batcher.core.admission import BatchLoad
from batcher.core.backend import Snapshot, Status, WorkerStatus
from batcher.fixed.counters import BatchCounters
from gateway.metrics import Metrics


def families(metrics: Metrics, snapshots: dict | None = None) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition(snapshots or {}).decode())}


def snapshot(counters: BatchCounters, load: BatchLoad) -> Snapshot:
    return Snapshot("fixed", Status(True, "", (), sum(load.queued), "requests"), counters.copy(), load)


def test_core_counters_are_read_from_the_snapshot_taken_at_scrape_time():
    counters = BatchCounters()
    metrics = Metrics()
    metrics.track("m@1", ["paid", "free"])
    counters.flushes["size"] += 3
    counters.restarts += 2
    counters.timed_out += 4
    counters.batch_sizes.observe(50)
    counters.queue_wait[1].observe(0.12)
    found = families(metrics, {"m@1": snapshot(counters, BatchLoad((120, 30), (0.0,), 50, 0.25))})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in found.values() for s in f.samples}
    assert samples[("ferry_flushes_total", (("model", "m@1"), ("reason", "size")))] == 3
    assert samples[("ferry_worker_restarts_total", (("model", "m@1"),))] == 2
    assert samples[("ferry_unanswered_requests_total", (("model", "m@1"),))] == 4
    assert samples[("ferry_batch_size_count", (("model", "m@1"),))] == 1
    assert samples[("ferry_queue_wait_seconds_sum", (("model", "m@1"), ("tier", "free")))] == 0.12
    assert samples[("ferry_queued_requests", (("model", "m@1"), ("tier", "paid")))] == 120
    # the 151st request of a worker taking 50 every 250 ms goes in its 4th batch
    assert samples[("ferry_estimated_wait_seconds", (("model", "m@1"), ("tier", "free")))] == 0.75


def test_gateway_families_are_exported_with_model_and_tier_labels():
    metrics = Metrics()
    metrics.requests.labels("m@1", "paid", "200").inc()
    metrics.ttft.labels("m@1", "paid").observe(0.3)
    metrics.admission_rejects.labels("m@1", "free", "shed").inc()
    found = families(metrics)
    assert {"ferry_requests", "ferry_ttft_seconds", "ferry_time_per_output_token_seconds",
            "ferry_request_latency_seconds", "ferry_admission_rejects", "ferry_safety_blocks"} <= set(found)
    assert found["ferry_requests"].samples[0].labels == {"model": "m@1", "tier": "paid", "status": "200"}


def test_several_backends_share_each_family_with_a_sample_per_model():
    metrics = Metrics()
    snapshots = {}
    for model in ("a@1", "b@1"):
        counters = BatchCounters()
        counters.retries = 3 if model == "a@1" else 4
        metrics.track(model, ["paid"])
        snapshots[model] = snapshot(counters, BatchLoad((0,), (), 1, 0.0))
    retries = families(metrics, snapshots)["ferry_batch_retries"]
    assert {s.labels["model"]: s.value for s in retries.samples if s.name.endswith("_total")} == {
        "a@1": 3,
        "b@1": 4,
    }


def test_a_priced_model_s_cost_per_million_tokens_is_its_workers_up_price_over_its_token_rate():
    now = [0.0]
    metrics = Metrics(clock=lambda: now[0])
    metrics.track("m@1", ["paid"], worker_hour_price=2.0)
    metrics.track("free@1", ["paid"])  # not priced: no figure
    workers = tuple(WorkerStatus(slot, pid, state, 0) for slot, pid, state in
                    [(0, 10, "idle"), (1, 11, "busy"), (2, None, "starting")])
    status = Status(True, "", workers, 0, "requests")
    up = Snapshot("fixed", status, BatchCounters(), BatchLoad((0,), (), 1, 0.0))

    def cost():
        samples = families(metrics, {"m@1": up, "free@1": up}).get("ferry_cost_per_million_tokens")
        return {s.labels["model"]: s.value for s in samples.samples} if samples else {}

    assert cost() == {}  # no token answered yet: no figure rather than infinity
    metrics.count_tokens("m@1", 60_000)  # 1,000 tokens/s over the rate's 60 s
    metrics.count_tokens("free@1", 60_000)
    assert cost() == {"m@1": pytest.approx(2 * 2.0 / 3600 / 1000 * 1e6)}  # 2 workers up, idle or busy
    now[0] = 60.0 * math.log(2)  # the rate has halved: each token costs twice as much
    assert cost() == {"m@1": pytest.approx(2 * 2 * 2.0 / 3600 / 1000 * 1e6)}
