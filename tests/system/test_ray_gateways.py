"""Two real ``ferry serve`` gateways on one Ray cluster (the session's): each owns its actors,
both answer through them (SmolLM2-135M once, on an engine in an actor), ``/readyz``, ``ferry
status`` and ``/metrics`` say where each worker runs, and a gateway that stops takes its actors
with it while the other keeps serving. Also the start-up errors a user meets: no cluster at the
address, no Ray installed."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time

import pytest

from batcher.fixed.config import FixedModelConfig
from batcher.fixed.worker import ProcessWorker
from batcher.placement.ray_actors import ray_workers
from tests.support.gateway_process import CONFIG, PAID, ROOT, Gateway, ferry, message
from tests.support.waiting import until

pytestmark = pytest.mark.usefixtures("ray_cluster")

HEAD = CONFIG.split("[[models]]")[0]  # server, tiers, keys of the shared test gateway


def ray_config(address: str, models: str) -> str:
    return HEAD + f'[ray]\naddress = "{address}"\nnamespace = "ferry-tests"\n\n' + models


FIXED = """[[models]]
name = "reverse@1"
aliases = ["reverse"]
workers = 2
worker = ["sleep", "--latency-ms", "20"]
max_wait_ms = 2
placement = "ray"
"""

SMOLLM2 = """[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
workers = 1
kv_memory_gb = 0.1
max_batch_tokens = 256
stats_timeout_ms = 60000
temperature = 0.0
placement = "ray"
"""


def ask_patiently(gateway: Gateway, body: dict, timeout: float = 180.0) -> tuple[int, dict]:
    """One request with a long client timeout: a real model's first answer on a busy 2-core
    machine can take longer than the shared helper's 30 s."""
    connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=timeout)
    try:
        connection.request("POST", "/v1/messages", body=json.dumps(body).encode(),
                           headers={"x-api-key": PAID, "content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def owners() -> dict[str, set[str]]:
    """Live ferry actors by the gateway that named (and owns) them."""
    import ray

    by_gateway: dict[str, set[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith("ferry:"):
            by_gateway.setdefault(name.split(":")[1], set()).add(name)
    return by_gateway


def test_two_gateways_on_one_cluster_answer_through_their_own_actors_and_say_where(ray_cluster, smollm2,
                                                                                  tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = Gateway(tmp_path / "a", ray_config(ray_cluster.address, FIXED + SMOLLM2))
    second = Gateway(tmp_path / "b", ray_config(ray_cluster.address, FIXED))
    try:
        for gateway in (first, second):
            status, _, body = gateway.request("POST", "/v1/messages", message("hello", model="reverse"))
            assert (status, body["content"][0]["text"]) == (200, "User: hello"[::-1])
        status, body = ask_patiently(first, message("What is the capital of France?", model="smollm2@1",
                                                    max_tokens=12))
        assert status == 200 and "Paris" in body["content"][0]["text"]
        head = f"ray:127.0.0.1:{ray_cluster.head_node.node_id[:8]}"
        models = first.ready()["models"]
        assert {w["placement"] for m in models.values() for w in m["workers"]} == {head}
        assert first.metric("ferry_worker_placement", model="reverse@1", slot="1", placement=head) == 1
        shown = ferry(first, "status")
        assert shown.returncode == 0 and "PLACEMENT" in shown.stdout and head in shown.stdout
        gateways = owners()
        assert len(gateways) == 2 and sorted(map(len, gateways.values())) == [2, 3]  # each its own actors
        first.stop()

        def one_owner() -> dict[str, set[str]] | None:  # Ray ends the actors of an owner that left
            left = owners()
            return left if len(left) == 1 else None

        left = until(one_owner, "the stopped gateway's actors to end", within=30, every=0.1)
        assert list(left.values()) == [gateways[next(iter(left))]]
        status, _, body = second.request("POST", "/v1/messages", message("still here", model="reverse"))
        assert (status, body["content"][0]["text"]) == (200, "User: still here"[::-1])
    finally:
        for gateway in (first, second):
            gateway.stop()


def test_no_cluster_at_the_address_is_a_start_up_error_naming_the_model_not_a_hang(tmp_path):
    path = tmp_path / "ferry.toml"
    path.write_text(ray_config("127.0.0.1:9", FIXED) + f'[state]\ndir = "{tmp_path}"\n')
    served = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 1
    assert "model 'reverse@1': no Ray cluster at '127.0.0.1:9'" in served.stdout


def test_without_ray_installed_a_ray_placed_model_is_refused_naming_the_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # the one stand-in: Ray is installed here
    model = FixedModelConfig(name="reverse@1", worker=("echo",), placement="ray")
    with pytest.raises(ValueError, match=r"model 'reverse@1': placement = 'ray' needs Ray: pip install"):
        ray_workers(model, model.worker, ProcessWorker)


def test_with_the_head_node_lost_running_workers_keep_serving_and_readyz_stays_true(ray_cluster, tmp_path):
    from ray.cluster_utils import Cluster

    doomed = Cluster(initialize_head=True, connect=False,  # its own head: this one's GCS is killed
                     head_node_args={"num_cpus": 1, "include_dashboard": False})
    gateway = Gateway(tmp_path, ray_config(doomed.address, FIXED))
    try:
        doomed.head_node.kill_gcs_server()
        deadline = time.monotonic() + 5  # well inside the 60 s Ray gives its processes to see a head
        answered = 0
        while time.monotonic() < deadline:
            text = f"q{answered}"
            status, _, body = gateway.request("POST", "/v1/messages", message(text, model="reverse"))
            assert (status, body["content"][0]["text"]) == (200, f"User: {text}"[::-1])
            answered += 1
        status, _, ready = gateway.request("GET", "/readyz")
        workers = ready["models"]["reverse@1"]["workers"]
        assert status == 200 and all(w["state"] != "starting" for w in workers)
        assert answered > 10
    finally:
        gateway.stop(signal.SIGKILL)
        doomed.shutdown()
