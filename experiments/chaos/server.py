"""One ``ferry serve`` process for a chaos scenario: its own config and state directory, a free
loopback port, its log in a file, and what the checks read of it (/readyz, the usage table, the
process's descriptors, threads and memory)."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from gateway.accounting.usage import UsageLog, UsageRecord, read_usage

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


class StartFailed(Exception):
    """``ferry serve`` exited before listening; the message is what it said."""


class Server:
    def __init__(self, config: str, workdir: pathlib.Path, start_timeout: float = 60.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.state = workdir / "state"
        path = workdir / "ferry.toml"
        path.write_text(config + f'\n[state]\ndir = "{self.state}"\n')
        self.log = workdir / "gateway.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log.open("wb"), text=True,
        )
        self.pid = self.process.pid
        lines = []
        deadline = time.monotonic() + start_timeout
        for line in self.process.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if "listening on http://" in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
                self.port = int(port)
                return
            if time.monotonic() > deadline:
                break
        self.process.wait(30)
        raise StartFailed(" / ".join(lines) or f"exit {self.process.returncode}")

    def get(self, path: str) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}
        finally:
            connection.close()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, by name and its sorted (label, value) pairs."""
        text = self.get("/metrics")[1]["raw"]
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def ready(self) -> bool:
        try:
            return self.get("/readyz")[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Seconds until /readyz says 200 (inf if it never does within ``timeout``)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.ready():
                return time.monotonic() - start
            time.sleep(0.02)
        return float("inf")

    def worker_pids(self) -> list[int]:
        models = self.get("/readyz")[1].get("models", {})
        return [w["pid"] for model in models.values() for w in model.get("workers", []) if w.get("pid")]

    def resources(self) -> dict[str, int]:
        """Open descriptors, threads and resident memory (KiB) of the gateway process."""
        status = pathlib.Path(f"/proc/{self.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
            "threads": int(fields["Threads"]),
            "rss_kib": int(fields["VmRSS"].split()[0]),
        }

    def usage(self) -> list[UsageRecord]:
        """The usage table as the gateway's next start finds it: with the rows a killed gateway
        had only journaled (opening the log writes them in, as that start would)."""
        path = self.state / "usage.sqlite"
        if not path.exists():
            return []
        UsageLog(str(path)).close()
        return read_usage(str(path))

    def send_signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Stop the gateway (it drains, then stops its workers); its exit status."""
        self.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            self.process.stdout.close()  # type: ignore[union-attr]
