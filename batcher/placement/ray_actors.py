"""Workers placed on a Ray cluster: the same worker to the pools, a Ray actor underneath.

A model with ``placement = "ray"`` gets a spawn whose workers are its mode's own worker class
(:func:`hosted`: the fixed mode's ``ProcessWorker``, the continuous mode's ``EngineProcess``)
with its frames flowing over a TCP connection to a Ray actor
(:class:`~batcher.placement.ray_host.WorkerHost`) instead of over pipes, so the pools,
supervision and the router see no difference. Ray is the control plane only: it starts an
actor, reports it dead and kills it; no frame passes through a Ray call (why, measured:
docs/ray.md). Each gateway owns its actors, named ``ferry:<gateway>:<model>:<slot>:<start>``;
``import ray`` happens only here and in :mod:`batcher.placement.ray_host`, lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import queue
import secrets
import socket
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from batcher.core.config import ModelConfig, RayConfig
from batcher.placement.local import P, PipeProcess
from batcher.placement.ray_host import SECRET_BYTES, WorkerHost
from workers.faults import INSTANCE_ENV
from workers.protocol import MAX_FRAME_BYTES, WorkerLost

PLACE_TIMEOUT = 60.0  # from asking Ray for an actor to its address: longer means no node has room
KILL_TIMEOUT = 5.0  # ray.kill waits on the head; a head that is down does not hold a stop longer
REACH_TIMEOUT = 5.0  # a head node's port must accept a connection within this
KEEPALIVE = (5, 2, 3)  # idle seconds, probe interval, probes: a silent peer's connection ends in ~11 s


class PlacementError(WorkerLost):
    """A worker could not be placed: no Ray, no cluster at the address, no node that fits, or
    the cluster did not answer. Its message names the model; supervision treats it as a worker
    that did not start (a clear start-up error first, a retried restart later)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ask:
    """What one worker's actor asks of a node."""

    num_gpus: float
    resources: Mapping[str, float]
    accelerator_type: str

    def wanted(self) -> dict[str, float]:
        """The node resources it needs, in Ray's names."""
        wanted = {"GPU": self.num_gpus, **self.resources}
        if self.accelerator_type:
            wanted[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {name: amount for name, amount in wanted.items() if amount > 0}


def fitting_nodes(nodes: Sequence[Mapping[str, Any]], ask: Ask) -> list[str]:
    """The ids of the live nodes (as ``ray.nodes()`` lists them) whose total resources hold ``ask``."""
    wanted = ask.wanted()
    return [node["NodeID"] for node in nodes if node.get("Alive")
            and all(node.get("Resources", {}).get(name, 0) >= amount for name, amount in wanted.items())]


_BOOKKEEPING = ("memory", "object_store_memory")  # resources Ray lists that no model asks for


class Cluster:
    """This process's connection to a Ray cluster, joined when the first worker is placed (Ray
    allows one per process, so there is one of these: :data:`CLUSTER`)."""

    def __init__(self, config: RayConfig = RayConfig()) -> None:
        self.config = config
        self.gateway = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"  # names our actors
        self._lock = threading.Lock()

    def join(self, model: str) -> None:
        """Connect (blocking: run in a thread); raise :class:`PlacementError` naming ``model``."""
        address = self.config.address
        if address == "local":  # read when Ray is first imported: set before
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private cluster reports nowhere
        import ray

        with self._lock:
            if ray.is_initialized():
                return
            try:
                if address == "local":
                    _start_private(self.config.namespace)
                else:
                    if address != "auto":
                        _reachable(address)
                    ray.init(address=address, namespace=self.config.namespace)
            except (ConnectionError, OSError, RuntimeError) as exc:
                raise PlacementError(f"model {model!r}: no Ray cluster at {address!r} ({exc})") from None

    def ask(self, model: ModelConfig) -> Ask:
        """The model's ask, checked against the cluster: some node must hold it."""
        import ray

        nodes = ray.nodes()
        gpus = model.num_gpus
        if gpus is None:
            has_gpus = any(n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0 for n in nodes)
            gpus = 1.0 if has_gpus else 0.0
        ask = Ask(gpus, dict(model.resources), model.accelerator_type)
        if not fitting_nodes(nodes, ask):
            offered = [{k: v for k, v in n.get("Resources", {}).items() if k not in _BOOKKEEPING
                        and not k.startswith("node:")} for n in nodes if n.get("Alive")]
            raise PlacementError(f"model {model.name!r}: no node of the Ray cluster has {ask.wanted()} "
                                 f"(live nodes offer {offered})")
        return ask

    def options(self, model: ModelConfig, name: str) -> dict[str, Any]:
        """Ray's actor options for one worker of ``model``: ferry supervises, so Ray restarts
        and retries nothing; a fleet is spread over the nodes that fit, so that losing one node
        costs a share of its capacity, not all of it."""
        ask = self.ask(model)
        return {"name": name, "namespace": self.config.namespace, "num_cpus": 0, "num_gpus": ask.num_gpus,
                "resources": dict(ask.resources), "accelerator_type": ask.accelerator_type or None,
                "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 1,
                "scheduling_strategy": "SPREAD"}


CLUSTER = Cluster()


def use_cluster(config: RayConfig) -> None:
    """Join this cluster when a worker is first placed (``ferry serve`` calls it at start)."""
    CLUSTER.config = config


def _start_private(namespace: str) -> None:
    """Start a one-node cluster on loopback from a thread that lives as long as this process:
    Ray ties its daemons' lives to the thread that started them (``PR_SET_PDEATHSIG``), and the
    thread that asks (trio's, for a blocking call) is retired once idle."""
    import ray

    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def host() -> None:
        try:
            ray.init(namespace=namespace, include_dashboard=False, _node_ip_address="127.0.0.1")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            outcome.put(exc)
            return
        outcome.put(None)
        threading.Event().wait()  # never set: the daemons live until the process ends

    threading.Thread(target=host, name="ferry-ray-cluster", daemon=True).start()
    error = outcome.get()
    if error is not None:
        raise error


def _reachable(address: str) -> None:
    """Fail in seconds, not Ray's minute of retries, when nothing listens at ``host:port``."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT):
        pass


_THREADS = trio.CapacityLimiter(1 << 20)  # a thread per worker waits on its actor: never a pool cap


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=_THREADS)


class RayHosted(PipeProcess):
    """A worker in a Ray actor: the launch, exit and kill of :class:`PipeProcess` done through
    Ray and a TCP connection (the frames themselves are the subclass's, unchanged)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], max_frame: int, *, model: ModelConfig,
                 cluster: Cluster, name: str) -> None:
        super().__init__(argv, env, max_frame)
        self.node: str | None = None  # Ray's node id, once placed
        self._program, self._model, self._cluster, self._name = list(argv), model, cluster, name
        self._actor: Any = None
        self._served: Any = None  # the actor's `serve` call: it ends when the worker does
        self._stream: trio.SocketStream | None = None
        self._stopped = False

    async def _launch(self) -> None:
        secret = secrets.token_bytes(SECRET_BYTES)
        with trio.move_on_after(PLACE_TIMEOUT):
            host, port, self.node, self.pid = await _in_thread(self._place, secret)
            self.placement = f"ray:{host}:{self.node[:8]}"
            stream = self._stream = await trio.open_tcp_stream(host, port)
            idle, interval, probes = KEEPALIVE
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
            await stream.send_all(secret)
            self._to_worker = self._from_worker = stream
            return
        raise PlacementError(f"model {self._model.name!r}: no actor placed within {PLACE_TIMEOUT:.0f}s "
                             "(the Ray cluster does not answer, or every node that fits is busy)")

    def _place(self, secret: bytes) -> tuple[str, int, str, int]:
        """Create the actor and learn where it listens (blocking, in a thread)."""
        self._cluster.join(self._model.name)
        import ray

        options = self._cluster.options(self._model, self._name)
        self._actor = ray.remote(WorkerHost).options(**options).remote(self._program, self._env, secret,
                                                                    self._model.python)
        if self._stopped:  # stopped while this thread was placing it
            ray.kill(self._actor, no_restart=True)
            raise PlacementError(f"model {self._model.name!r}: stopped while placing")
        try:
            address = ray.get(self._actor.address.remote())
        except ray.exceptions.RayError as exc:
            raise PlacementError(f"model {self._model.name!r}: the actor died starting ({exc})") from None
        self._served = self._actor.serve.remote()
        return address

    async def _lost(self) -> str:
        return f"actor pid {self.pid} on {self.placement}: connection closed"

    async def wait_exit(self) -> None:
        assert self._served is not None, "wait_exit before start"
        await _in_thread(self._exit_code)

    def _exit_code(self) -> int | None:
        import ray

        try:
            return ray.get(self._served)
        except ray.exceptions.RayError:  # the actor, or its node, died
            return None

    async def stop(self, grace: float = 0.0) -> None:
        self._stopped = True
        if self._actor is not None:
            import ray

            with trio.move_on_after(KILL_TIMEOUT):
                await _in_thread(ray.kill, self._actor)
        if self._stream is not None:
            await self._stream.aclose()


@functools.cache
def hosted(kind: type[PipeProcess]) -> type[RayHosted]:
    """A worker of ``kind`` (a mode's side of its process) in a Ray actor: ``kind``'s frames over
    :class:`RayHosted`'s launch, exit and kill."""
    return type(f"Ray{kind.__name__}", (RayHosted, kind), {"__doc__": f"A {kind.__name__} in a Ray actor."})


def ray_workers(model: ModelConfig, argv: Sequence[str], kind: type[P],
                cluster: Cluster = CLUSTER) -> Callable[[int], P]:
    """A spawn whose workers of ``kind`` run ``python -m workers *argv`` in Ray actors; each
    start is named (``SLOT:START``) in its environment, as a local worker's is."""
    try:
        missing = importlib.util.find_spec("ray") is None
    except ValueError:  # a module set to None in sys.modules: not importable either
        missing = True
    if missing:
        needs = "placement = 'ray' needs Ray: pip install 'trio-ferry[ray]'"
        raise ValueError(f"model {model.name!r}: {needs}") from None
    starts: Counter[int] = Counter()

    def spawn(slot: int) -> P:
        starts[slot] += 1
        instance = f"{slot}:{starts[slot]}"
        name = f"ferry:{cluster.gateway}:{model.name}:{instance}"
        env = {INSTANCE_ENV: instance}
        # hosted(kind) subclasses both RayHosted and kind, an intersection mypy cannot spell; and a
        # class is hashable, which mypy does not see in type[P] (python/mypy#20409)
        worker: Callable[..., P] = hosted(kind)  # type: ignore[arg-type, assignment]  # see above
        return worker(argv, env, MAX_FRAME_BYTES, model=model, cluster=cluster, name=name)

    return spawn
