"""What an operator reads of each mode, over a real ``ferry serve`` with a fixed-mode model and a
continuous one (a simulated engine process) side by side: ``ferry status``, ``/readyz`` and
``/metrics`` show the same queued work, each in its own unit, and each model exports only the
families of its own mode."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_process import PAID, ROOT, Gateway

CONFIG = f"""
[server]
port = 0
ping_interval_ms = 200

[[tiers]]
name = "paid"
wait_budget_ms = 60000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"

[[models]]
name = "echo@1"
worker = ["echo"]
workers = 1

[[models]]
name = "sim@1"
mode = "continuous"
simulated = "llama-70b"
workers = 1
max_seqs = 1
num_blocks = 512
"""

BATCH_ONLY = ("ferry_flushes", "ferry_batch_size", "ferry_batch_retries", "ferry_bisections")


class Stream:
    """A streamed request that holds the engine's one sequence until :meth:`leave`."""

    def __init__(self, gateway: Gateway) -> None:
        self.connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=60)
        body = {"model": "sim@1", "max_tokens": 4000, "stream": True,
                "messages": [{"role": "user", "content": "hold the engine"}]}
        self.connection.request("POST", "/v1/messages", body=json.dumps(body), headers={"x-api-key": PAID})
        self.response = self.connection.getresponse()

    def wait_for_text(self) -> None:
        while b"content_block_delta" not in self.response.readline():
            pass

    def leave(self) -> None:
        self.connection.close()


@pytest.fixture
def gateway(tmp_path):
    server = Gateway(tmp_path, CONFIG)
    yield server
    assert server.stop() == 0


def test_status_readyz_and_metrics_show_a_continuous_models_queued_tokens_and_no_batch_family(gateway):
    answered = gateway.request("POST", "/v1/messages", {
        "model": "echo@1", "max_tokens": 40, "messages": [{"role": "user", "content": "flush me"}]})
    assert answered[0] == 200  # the fixed model has flushed a batch
    holder = Stream(gateway)
    holder.wait_for_text()
    queued: list = []
    waiting = threading.Thread(target=lambda: queued.append(gateway.request("POST", "/v1/messages", {
        "model": "sim@1", "max_tokens": 40, "messages": [{"role": "user", "content": "wait for it"}]})))
    waiting.start()
    try:
        models = gateway.wait_for(lambda models: models["sim@1"]["queued"] > 0)
        tokens = models["sim@1"]["queued"]
        command = [sys.executable, "-m", "gateway.cli", "status", "--config", str(gateway.config_path)]
        status = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                                check=True).stdout
        text = gateway.request("GET", "/metrics", key=None)[2]["raw"].decode()
    finally:
        holder.leave()  # the engine takes the queued request
        waiting.join(60)
    assert queued[0][0] == 200
    assert tokens >= len("wait for it")  # its prompt's tokens, not yet prefilled
    assert (models["sim@1"]["queued_unit"], models["echo@1"]["queued_unit"]) == ("tokens", "requests")
    rows = {line.split()[0]: line for line in status.splitlines() if "@1" in line and "serving" in line}
    assert rows["sim@1"].split()[-3:] == [str(tokens), "tokens", "local"]  # QUEUED, then PLACEMENT
    assert rows["echo@1"].split()[-3:] == ["0", "requests", "local"]
    assert f"tests   sim@1    {tokens} tokens" in status  # the tenants with the most work queued

    families = {f.name: f for f in text_string_to_metric_families(text)}
    by_model: dict[str, set[str]] = {"sim@1": set(), "echo@1": set()}
    for family in families.values():
        for sample in family.samples:
            if sample.labels.get("model") in by_model:
                by_model[sample.labels["model"]].add(family.name)
    assert not by_model["sim@1"] & {*BATCH_ONLY, "ferry_queued_requests"}
    assert set(BATCH_ONLY) <= by_model["echo@1"] and "ferry_engine_reruns" not in by_model["echo@1"]
    assert "ferry_queued_work" not in families  # no family whose unit depends on the model
    assert "ferry_engine_reruns" in by_model["sim@1"]
    sim = [s.value for s in families["ferry_queued_tokens"].samples if s.labels["model"] == "sim@1"]
    assert sim == [tokens]  # one tier
    assert {s.labels["model"] for s in families["ferry_queued_requests"].samples} == {"echo@1"}
    by_tenant = {(s.labels["model"], s.labels["tenant"], s.labels["outcome"]): s.value
                 for s in families["ferry_tenant_requests"].samples}
    assert by_tenant == {("echo@1", "tests", "completed"): 1.0}  # the config names its one tenant
