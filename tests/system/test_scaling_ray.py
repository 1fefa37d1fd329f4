"""The scaler over Ray actors (the session's cluster, on loopback): a fixed model at
``min_workers = 1, max_workers = 2`` adds an actor for a burst and gives it back after, losing
nothing; a continuous model at ``min_workers = 0`` starts an actor for its first request and
stops it after ``idle_after_s``; over a real ``ferry serve`` and HTTP, SmolLM2 at ``min_workers
= 0`` answers its first request after a cold start in an actor and stops it when idle, and two
fixed versions sharing a one-slot pool take turns on it, an actor each.

The real clock runs these (actors, sockets, subprocesses); bounds are generous and nothing
asserts speed."""

from __future__ import annotations

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.mode import open_continuous
from batcher.core.backend import Finished
from batcher.core.config import QueueConfig
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.mode import open_fixed
from batcher.fixed.worker import ProcessWorker
from batcher.placement.spawn import placed
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import Client, job
from tests.support.fixed_batcher import submit_all
from tests.support.gateway_process import Gateway, message, on_ray
from tests.support.waiting import until_trio

pytestmark = pytest.mark.usefixtures("ray_cluster")

QUEUE = QueueConfig(wait_budgets=(30.0, 30.0))


async def test_a_fixed_model_on_ray_adds_an_actor_for_a_burst_and_gives_it_back():
    model = FixedModelConfig(name="ray-elastic@1", worker=("sleep", "--latency-ms", "200"), placement="ray",
                             min_workers=1, max_workers=2, max_batch=4, max_wait_ms=10,
                             scale_down_after_s=1.0, hang_timeout_ms=5000)
    spawn = placed(model, model.worker, ProcessWorker)
    async with open_fixed(model, QUEUE, spawn, ByteTokenizer()) as batcher:
        inputs = [f"request {i}" for i in range(300)]  # 15 s of one worker
        outcome: dict = {}
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                outcome.update(await submit_all(batcher, inputs))

            nursery.start_soon(run)
            await until_trio(lambda: batcher.pool.fleet().serving == 2, "a second actor serving", within=60)
            grown = [w.placement for w in batcher.pool.workers()]
        await until_trio(lambda: len(batcher.pool.workers()) == 1, "back to one actor", within=60)
    assert outcome == {text: text[::-1] for text in inputs}
    assert len(grown) == 2 and all(p.startswith("ray:") for p in grown)
    assert batcher.counters.scale_events[("down", "spare")] >= 1


async def test_a_continuous_model_on_ray_at_zero_starts_an_actor_for_its_first_request_and_stops_it():
    config = ContinuousModelConfig(name="ray-sim@1", simulated="llama-70b", placement="ray", num_blocks=64,
                                   max_batch_tokens=64, max_seqs=16, min_workers=0, max_workers=1,
                                   idle_after_s=1.0)
    spawn = placed(config, [*config.engine_argv(), "--sim-eos-prob", "0"], EngineProcess)
    async with open_continuous(config, QUEUE, spawn, ByteTokenizer()) as pool:
        empty = pool.snapshot().status.workers
        first = Client()
        pool.submit(job(1, 8, stream=False), first)
        with trio.fail_after(60):
            await first.done.wait()
        started = pool.snapshot().status
        await until_trio(lambda: not pool.snapshot().status.workers, "the actor stopped", within=60)
    assert empty == () and isinstance(first.events[-1], Finished)
    assert started.workers[0].placement.startswith("ray:") and started.details["start_seconds"] > 0


SMOLLM2_AT_ZERO = """[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
kv_memory_gb = 0.1
max_batch_tokens = 256
stats_timeout_ms = 60000
temperature = 0.0
dtype = "float32"
placement = "ray"
min_workers = 0
max_workers = 1
idle_after_s = 1.0
"""


def test_smollm2_on_ray_at_zero_answers_after_a_cold_start_and_stops_when_idle(ray_cluster, smollm2,
                                                                              tmp_path):
    gateway = Gateway(tmp_path, on_ray(ray_cluster.address, SMOLLM2_AT_ZERO))
    try:
        empty = gateway.ready()["models"]["smollm2@1"]
        question = message("What is the capital of France?", model="smollm2@1", max_tokens=12)
        status, _, answer = gateway.request("POST", "/v1/messages", question, timeout=180)
        started = gateway.ready()["models"]["smollm2@1"]
        idle = gateway.wait_for(lambda models: not models["smollm2@1"]["workers"], timeout=60,
                                what="the actor stopped")
    finally:
        assert gateway.stop() == 0
    assert empty["workers"] == [] and empty["ready"]
    assert status == 200 and "Paris" in answer["content"][0]["text"]
    assert started["workers"][0]["placement"].startswith("ray:") and started["start_seconds"] > 0
    assert idle["smollm2@1"]["scaling"] == "down 1 -> 0 (idle): no work for 1s"


SHARED = """[[pools]]
name = "rare"
slots = 1

[[models]]
name = "first@1"
worker = ["sleep", "--latency-ms", "10"]
placement = "ray"
pool = "rare"

[[models]]
name = "second@1"
worker = ["sleep", "--latency-ms", "10"]
placement = "ray"
pool = "rare"
"""


def test_two_versions_on_ray_take_turns_on_a_one_slot_pool(ray_cluster, tmp_path):
    gateway = Gateway(tmp_path, on_ray(ray_cluster.address, SHARED))
    try:
        first = gateway.request("POST", "/v1/messages", message("<1>", model="first@1"))
        second = gateway.request("POST", "/v1/messages", message("<2>", model="second@1"))
        models = gateway.ready()["models"]
    finally:
        assert gateway.stop() == 0
    assert (first[0], second[0]) == (200, 200) and ">2<" in second[2]["content"][0]["text"]
    assert models["first@1"]["workers"] == [] and "(evicted)" in models["first@1"]["scaling"]
    assert [w["placement"][:4] for w in models["second@1"]["workers"]] == ["ray:"]
