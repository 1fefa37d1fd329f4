"""The Ray cluster of the ``ray-partition`` row: one worker node cut off by the network, not killed.

Two hosts of the row's own, joined by a veth link: the host side (``10.213.0.1``) runs the head
(no worker slot) and one worker node; a network namespace (``10.213.0.2``) runs the other worker
node, started with ``ray start --block`` inside it. :meth:`PartitionedNodes.cut` takes the link
down for a bounded time and brings it back up, so the cut node's raylet, actors and worker programs
go on running, unreachable: Ray's health checks (tightened as in :mod:`.ray_nodes`) declare the
node dead, and when the link returns the node learns it was declared dead and ends. Needs root and
``ip`` (iproute2); :func:`unavailable` says why not where either is missing.

Every exit path removes what the row made: the namespace's processes (by the namespace's own pid
list, nothing else), the namespace, and the veth pair, each step bounded in time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.chaos.ray_nodes import HEALTH, SLOT

HOST_IP, NODE_IP, PREFIX = "10.213.0.1", "10.213.0.2", 24
STEP_TIMEOUT = 10.0  # each `ip` call, and each wait for the namespace's processes to end
JOIN_TIMEOUT = 60.0  # the namespace's node registered with the head
# A killed raylet refuses the head's health checks at once; a cut-off one never answers, so each
# check waits out its timeout (Ray's default 10 s: ~30 s to call the node dead, longer than the
# cut). Tightened so the node is declared dead ~2 s into the cut, as a killed one is.
PARTITION_HEALTH = {**HEALTH, "health_check_timeout_ms": 500}


def unavailable() -> str | None:
    """Why this machine cannot run the row (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and veth links)"
    if shutil.which("ip") is None:
        return "needs `ip` (Debian's iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, timeout=STEP_TIMEOUT, capture_output=True)


class PartitionedNodes:
    """The cluster (joined by this process, to watch its nodes); same face as
    :class:`~experiments.chaos.ray_nodes.RayNodes` plus :meth:`cut`."""

    def __init__(self, workers: int) -> None:
        tag = os.getpid() % 100000
        self.netns, self.host_link, self.node_link = f"ferry-n{tag}", f"fyh{tag}", f"fyn{tag}"
        self._node: subprocess.Popen | None = None
        try:
            self._link()
            self._start(workers)
        except BaseException:
            self.stop()
            raise

    def _link(self) -> None:
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.node_link)
        _ip("link", "set", self.node_link, "netns", self.netns)
        _ip("addr", "add", f"{HOST_IP}/{PREFIX}", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        _ip("netns", "exec", self.netns, "ip", "addr", "add", f"{NODE_IP}/{PREFIX}", "dev", self.node_link)
        _ip("netns", "exec", self.netns, "ip", "link", "set", self.node_link, "up")
        _ip("netns", "exec", self.netns, "ip", "link", "set", "lo", "up")

    def _start(self, workers: int) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "node_ip_address": HOST_IP,
            "_system_config": PARTITION_HEALTH})
        self.cluster.add_node(num_cpus=1, resources={SLOT: workers}, node_ip_address=HOST_IP)
        self._log = tempfile.TemporaryFile()  # the namespace node's output, shown if it does not join
        ray_cli = str(Path(sys.executable).with_name("ray"))
        self._node = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, ray_cli, "start", "--block",
             "--address", self.cluster.address,
             "--node-ip-address", NODE_IP, "--num-cpus", "1", "--resources", json.dumps({SLOT: workers}),
             "--disable-usage-stats"],
            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},  # Ray's gate for a second host
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        ray.init(address=self.cluster.address, log_to_driver=False)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while self.cut_node() is None:
            if time.monotonic() > deadline or self._node.poll() is not None:
                self._log.seek(0)
                said = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"the namespace's Ray node did not join in {JOIN_TIMEOUT:.0f} s: {said}")
            time.sleep(0.2)
        self.address = self.cluster.address

    def cut_node(self, alive: bool = True) -> str | None:
        """The namespace's node id (Ray's view, alive or not as asked), or None."""
        import ray

        return next((n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == NODE_IP
                     and n["Alive"] == alive), None)

    def gateway_actors(self) -> int:
        """How many live actors the cluster holds under a gateway's names (``ferry:...``)."""
        import ray

        return sum(a["name"].startswith("ferry:") for a in ray.util.list_named_actors(all_namespaces=True))

    def cut(self, length: float) -> str:
        """Take the link down for ``length`` seconds, then back up; return the cut node's id prefix."""
        node = self.cut_node()
        assert node is not None, "the namespace's node is not alive"
        _ip("link", "set", self.host_link, "down")
        try:
            time.sleep(length)
        finally:
            _ip("link", "set", self.host_link, "up")
        return node[:8]

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if hasattr(self, "cluster"):
            self.cluster.shutdown()
        self._end_namespace()
        _ip("link", "del", self.host_link, check=False)  # takes its peer with it
        _ip("netns", "del", self.netns, check=False)

    def _end_namespace(self) -> None:
        """SIGKILL what runs in the namespace (the node's raylet and its workers, by the namespace's
        own pid list), then reap the ``ray start`` this object started."""
        listing = subprocess.run(["ip", "netns", "pids", self.netns], timeout=STEP_TIMEOUT,
                                 capture_output=True, text=True, check=False)
        for pid in listing.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._node is not None:
            try:
                os.killpg(self._node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._node.wait(timeout=STEP_TIMEOUT)
