"""A real ``ferry serve`` process for integration tests: its own config, port 0 on loopback,
real worker processes, talked to over real HTTP and through ``ferry``'s own commands."""

from __future__ import annotations

import hashlib
import http.client
import json
import pathlib
import signal
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import until

ROOT = pathlib.Path(__file__).parents[2]
PAID = "sk-test-paid-0001"
FREE = "sk-test-free-0002"



def tiers_and_keys(paid_budget_ms: int, free_budget_ms: int | None = None) -> str:
    """The ``[[tiers]]`` paid (and free, where it has a budget) with these wait budgets, and the
    ``[[keys]]`` of :data:`PAID` (and :data:`FREE`, given by its digest), as most tests'
    configurations have them."""
    paid = f"""
[[tiers]]
name = "paid"
wait_budget_ms = {paid_budget_ms}

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"
"""
    if free_budget_ms is None:
        return paid
    return paid + f"""
[[tiers]]
name = "free"
wait_budget_ms = {free_budget_ms}

[[keys]]
key_sha256 = "{hashlib.sha256(FREE.encode()).hexdigest()}"
tenant = "tests"
tier = "free"
"""


CONFIG = f"""
[server]
host = "127.0.0.1"
port = 0
max_body_bytes = 65536
ping_interval_ms = 100
shutdown_grace_ms = 10000

{tiers_and_keys(10000, 300)}

[[models]]
name = "sleepy@1"
aliases = ["sleepy"]
workers = 4
worker = ["sleep", "--latency-ms", "200"]
max_batch = 50
max_wait_ms = 20

[[models]]
name = "echo@1"
aliases = ["echo"]
workers = 2
worker = ["echo", "--poison", "POISON"]
max_batch = 16
max_wait_ms = 1
context_window = 256

[[models]]
name = "held@1"
workers = 1
worker = ["echo"]
max_batch = 50
max_wait_ms = 60000
"""


class Gateway:
    """One ``ferry serve`` subprocess; its stderr (gateway and worker logs) goes to a file."""

    def __init__(self, tmp: pathlib.Path, config: str = CONFIG) -> None:
        if "[state]" not in config:  # its own usage records, idempotent answers and admin socket
            config += f'\n[state]\ndir = "{tmp}"\n'
        self.tmp = tmp
        path = self.config_path = tmp / "ferry.toml"
        path.write_text(config)
        self.log = tmp / "gateway.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log.open("wb"), text=True,
        )
        self.lines: list[str] = []
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if "listening on http://" in line:
                self.host, port = line.rsplit("http://", 1)[1].strip().rsplit(":", 1)
                self.port = int(port)
                self.url = f"http://{self.host}:{self.port}"
                return
        raise RuntimeError(f"ferry serve did not start: {self.lines} {self.log.read_text()[-2000:]}")

    def request(self, method: str, path: str, body: object = None, headers: dict | None = None,
                key: str | None = PAID, timeout: float = 30.0) -> tuple[int, dict, dict]:
        """One request on a fresh connection: status, headers, and the JSON body ({"raw": bytes}
        when the answer is not JSON); ``timeout`` longer for a real model's cold start."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            sent = {"x-api-key": key} if key else {}
            connection.request(method, path, body=data, headers={**sent, **(headers or {})})
            response = connection.getresponse()
            raw = response.read()
            is_json = response.getheader("Content-Type", "").startswith("application/json")
            return response.status, dict(response.getheaders()), json.loads(raw) if is_json else {"raw": raw}
        finally:
            connection.close()

    def ready(self) -> dict:
        return self.request("GET", "/readyz")[2]

    def wait_for(self, condition, timeout: float = 20.0, what: str = "a condition on /readyz"):
        """Poll /readyz until ``condition(models)`` is true; return the models' state."""

        def models() -> dict:
            found = self.ready().get("models", {})
            return found if found and condition(found) else {}

        try:
            return until(models, what, within=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last /readyz: {self.ready()}") from None

    def metric(self, name: str, absent: float | None = None, **labels: str) -> float:
        """One sample of /metrics, by name and labels; ``absent`` where there is none yet (else
        an AssertionError)."""
        text = self.request("GET", "/metrics", key=None)[2]["raw"].decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        if absent is not None:
            return absent
        raise AssertionError(f"/metrics has no sample {name} {labels}")

    def worker_pids(self) -> list[int]:
        models = self.ready()["models"]
        return [w["pid"] for model in models.values() for w in model["workers"] if w["pid"]]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        finally:
            self.process.stdout.close()  # type: ignore[union-attr]


def ferry(gateway: Gateway, *args: str) -> subprocess.CompletedProcess:
    """``ferry ARGS --config FILE`` against this gateway's file, as its operator runs it."""
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--config", str(gateway.config_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def message(text: str = "hello", model: str = "echo", **fields) -> dict:
    return {"model": model, "max_tokens": 200, "messages": [{"role": "user", "content": text}], **fields}


def on_ray(address: str, models: str) -> str:
    """The shared test gateway's server, tiers and keys, its workers on the session's cluster;
    paid waits out a real model's cold start."""
    head = CONFIG.split("[[models]]")[0].replace("wait_budget_ms = 10000", "wait_budget_ms = 180000")
    return head + f'[ray]\naddress = "{address}"\nnamespace = "ferry-tests"\n\n' + models
