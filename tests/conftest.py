"""Shared test helpers: a fleet of inspectable simulated workers, real redis-servers."""

from __future__ import annotations

import pathlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

from batcher.sim.workers import SimulatedWorker, constant
from workers.faults import FaultPlan


class Fleet:
    """A Spawn for the pool: simulated workers, with a fault plan per slot if asked.

    ``plans[slot]`` applies to the first worker spawned in that slot only; its replacement
    after a restart is healthy, like a GPU whose process crashed once. ``every`` applies to
    every worker spawned while it is set (a broken build; set it to None to deploy the fix).
    """

    def __init__(
        self, plans: dict[int, FaultPlan] | None = None, service: float = 0.2, every: FaultPlan | None = None
    ) -> None:
        self.plans = dict(plans or {})
        self.service = service
        self.every = every
        self.spawned: list[tuple[int, SimulatedWorker]] = []

    def __call__(self, slot: int) -> SimulatedWorker:
        plan = self.plans.pop(slot, self.every or FaultPlan())
        worker = SimulatedWorker(constant(self.service), plan)
        self.spawned.append((slot, worker))
        return worker

    def worker(self, slot: int) -> SimulatedWorker:
        """The worker spawned last in ``slot``."""
        return [worker for s, worker in self.spawned if s == slot][-1]

    def calls(self, slot: int | None = None) -> list[list[str]]:
        """Inputs of every call, in order per worker, of one slot or of all."""
        return [call for s, worker in self.spawned if slot in (None, s) for call in worker.calls]

    def inputs_seen(self) -> list[str]:
        return [text for call in self.calls() for text in call]


@pytest.fixture
def fleet_factory():
    return Fleet


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real redis-server on loopback that a test may stop, freeze (SIGSTOP) and restart on
    the same port. Nothing is saved to disk: a restarted server starts empty."""

    def __init__(self, workdir) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed: `apt-get install redis-server` (the CI script does)")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.process.kill()
                    pytest.fail(f"redis-server did not answer on port {self.port}")
                time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP, and return once the process is stopped: it answers nothing from then on."""
        self.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        stat = pathlib.Path(f"/proc/{self.process.pid}/stat")  # type: ignore[union-attr]
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)

    def thaw(self) -> None:
        self.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback for the whole session (CI installs it; see .ci/run)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own, to stop, freeze and restart."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
