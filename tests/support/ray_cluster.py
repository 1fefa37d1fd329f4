"""One real Ray cluster on loopback for the whole test run (its start-up, ~5 s, is paid once):
a head node of ``cluster_utils.Cluster`` that tests add raylets to and remove them from.
The fixtures plugin (tests/support/fixtures.py) makes it every test's fixture."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """The cluster, joined by this process (the driver that owns every test's actors); ferry's
    placement joins it too, through ``use_cluster``."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    import ray
    from ray.cluster_utils import Cluster

    from batcher.core.config import RayConfig
    from batcher.placement.ray_actors import CLUSTER, use_cluster

    # A removed raylet is declared dead after ~1.5 s of missed health checks, not Ray's ~30 s.
    health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
              "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                           "_system_config": health})
    ray.init(address=cluster.address, namespace="ferry-tests", log_to_driver=False)
    before = CLUSTER.config
    use_cluster(RayConfig(address=cluster.address, namespace="ferry-tests"))
    try:
        yield cluster
    finally:
        use_cluster(before)
        ray.shutdown()
        cluster.shutdown()
