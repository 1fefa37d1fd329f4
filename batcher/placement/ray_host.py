"""What runs inside a Ray actor: one worker program whose stdin and stdout are a TCP connection
that the gateway dials.

The actor is a host, not a relay: it listens on its node's address, takes the first connection
that presents the actor's secret, and starts ``python -m workers ...`` with that socket as the
program's fds 0 and 1, so frames go straight between the gateway and the unchanged worker
program (no copy in the actor, no Ray call per frame). :meth:`WorkerHost.serve` returns the
program's exit code; the gateway holds that call open for the worker's life, so its end (or
Ray's ``ActorDiedError``) is the worker's exit, and the gateway's pool decides what follows.
Imported by the Ray worker process that hosts the actor; ``ray`` only inside
:meth:`WorkerHost.address`.
"""

from __future__ import annotations

import hmac
import os
import socket
import subprocess
import sys
import time

SECRET_BYTES = 32
ACCEPT_TIMEOUT = 60.0  # the gateway dials at once; an actor never dialled gives up after this
AUTH_TIMEOUT = 5.0  # a connection must present the secret within this
MAX_REFUSED = 16  # connections without the secret before the host stops listening


def _unnice(pid: int) -> None:
    """Run the worker program at normal priority: Ray starts its workers at niceness 15 (below
    its own daemons), which a GPU's feeding process must not inherit. Where the node does not
    allow raising a priority (no CAP_SYS_NICE), start Ray with ``RAY_worker_niceness=0``."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 0)
    except OSError:
        pass


class WorkerHost:
    """One worker program's host inside a Ray actor (see the module doc)."""

    def __init__(self, argv: list[str], env: dict[str, str], secret: bytes, python: str = "") -> None:
        # The model's own interpreter where it names one (a path on the node), else the actor's.
        self._argv = [os.path.expanduser(python) if python else sys.executable, "-m", "workers", *argv]
        # This node's environment, with Ray's CUDA_VISIBLE_DEVICES, without the OMP_NUM_THREADS=1
        # Ray sets for an actor that asks for no CPU: the program sizes its threads as a local one.
        self._env = {name: value for name, value in {**os.environ, **env}.items()
                     if name != "OMP_NUM_THREADS"}
        self._secret = secret
        self._listener: socket.socket | None = None

    def address(self) -> tuple[str, int, str, int]:
        """Start listening; return (address, port, node id, this actor's pid)."""
        import ray

        host = ray.util.get_node_ip_address()
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        return host, port, ray.get_runtime_context().get_node_id(), os.getpid()

    def serve(self) -> int:
        """Take the gateway's connection, run the worker program on it, return its exit code
        (-1 when no connection with the secret came)."""
        assert self._listener is not None, "serve before address"
        with self._listener:
            connection = self._accept(self._listener)
        if connection is None:
            return -1
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = connection.fileno()
            program = subprocess.Popen(self._argv, stdin=fd, stdout=fd, env=self._env)
        _unnice(program.pid)
        return program.wait()

    def _accept(self, listener: socket.socket) -> socket.socket | None:
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        for _ in range(MAX_REFUSED):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            listener.settimeout(remaining)
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                return None
            if self._presents_secret(connection):
                connection.setblocking(True)  # the worker program reads and writes it blocking
                return connection
            connection.close()
        return None

    def _presents_secret(self, connection: socket.socket) -> bool:
        connection.settimeout(AUTH_TIMEOUT)
        received = b""
        try:
            while len(received) < SECRET_BYTES:
                chunk = connection.recv(SECRET_BYTES - len(received))
                if not chunk:
                    return False
                received += chunk
        except OSError:
            return False
        return hmac.compare_digest(received, self._secret)
