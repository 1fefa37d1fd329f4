"""Shared test helpers: a fleet of inspectable simulated workers, a real redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from workers.faults import FaultPlan
from workers.simulated import SimulatedWorker, constant


class Fleet:
    """A Spawn for the pool: simulated workers, with a fault plan per slot if asked.

    ``plans[slot]`` applies to the first worker spawned in that slot only; its replacement
    after a restart is healthy, like a GPU whose process crashed once.
    """

    def __init__(self, plans: dict[int, FaultPlan] | None = None, service: float = 0.2) -> None:
        self.plans = dict(plans or {})
        self.service = service
        self.spawned: list[tuple[int, SimulatedWorker]] = []

    def __call__(self, slot: int) -> SimulatedWorker:
        worker = SimulatedWorker(constant(self.service), self.plans.pop(slot, FaultPlan()))
        self.spawned.append((slot, worker))
        return worker

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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback for the whole session (CI installs it; see .ci/run)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: `apt-get install redis-server` (the CI script does)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail(f"redis-server did not answer on port {port}")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)


TINY_CHECKPOINTS = {
    # name: how it is written (workers.engine.tiny_checkpoint)
    "tied": {"tied": True},
    "untied-llama3": {"tied": False, "rope_scaling": "llama3", "seed": 1},
    "tied-linear": {"tied": True, "rope_scaling": "linear", "seed": 2, "num_layers": 3},
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random Llama checkpoints with a real tokenizer, by name (see TINY_CHECKPOINTS)."""
    from workers.engine.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_checkpoint(root / name, **kwargs) for name, kwargs in TINY_CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints):
    return tiny_checkpoints["tied"]
