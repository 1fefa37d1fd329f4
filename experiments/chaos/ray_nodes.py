"""The Ray cluster a Ray-placed chaos row's gateway runs its workers on: a head that hosts no
worker and two raylets on loopback with room for every worker each, so that losing one node
leaves room for its workers' replacements on the other. Health checks are tightened (a removed
raylet is dead to Ray in ~1.5 s instead of ~30 s) so a row's seconds measure ferry, not Ray's
failure detector."""

from __future__ import annotations

import os

SLOT = "ferry_slot"  # the custom resource each worker asks one of: only the two worker nodes have it
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
          "health_check_failure_threshold": 3}


class RayNodes:
    """Start the cluster (and join it, to watch its nodes); :meth:`lose` kills one raylet."""

    def __init__(self, workers: int) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH})
        self.nodes = [self.cluster.add_node(num_cpus=1, resources={SLOT: workers}) for _ in range(2)]
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def lose(self, placements: list[str]) -> str:
        """Kill the raylet (and so every actor) of the worker node that holds the most of these
        workers' placements (``ray:<address>:<node id prefix>``); return its id prefix."""
        busiest = max(self.nodes, key=lambda node: sum(p.endswith(node.node_id[:8]) for p in placements))
        self.cluster.remove_node(busiest, allow_graceful=False)
        self.nodes.remove(busiest)
        return busiest.node_id[:8]

    def stop(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
