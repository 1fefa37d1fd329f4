"""Workers of both modes placed on a real Ray cluster (the session's, on loopback): they answer
as local ones do, an actor SIGKILLed mid-batch or mid-stream costs no request that can be
re-run, and a node removed under load costs none at all.

The real clock runs these (actors, sockets, subprocesses); bounds are generous and nothing
asserts speed.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Delta, Failed, Finished, Started
from batcher.core.config import PoolConfig
from batcher.core.errors import ReplicaLost
from batcher.core.supervisor import WorkerStartError
from batcher.fixed.batcher import open_batcher
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.slot import SlotState
from batcher.fixed.worker import ProcessWorker
from batcher.placement.spawn import placed
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import QUEUE, Client, job
from tests.support.fixed_batcher import submit_all
from tests.support.processes import bytes_written, process_tree, worker_pids, worker_program
from tests.support.vllm_server import VLLM_PYTHON, vllm_installed
from tests.support.waiting import until_trio

pytestmark = pytest.mark.usefixtures("ray_cluster")


def fixed(workers: int = 2, latency_ms: int = 200, **fields) -> FixedModelConfig:
    return FixedModelConfig(name="ray-fixed@1", worker=("sleep", "--latency-ms", str(latency_ms)),
                            workers=workers, placement="ray", **fields)


@contextlib.asynccontextmanager
async def batcher_of(model: FixedModelConfig, hang_timeout: float = 5.0):
    spawn = placed(model, model.worker, ProcessWorker)
    config = PoolConfig(workers=model.workers, hang_timeout=hang_timeout)
    async with open_batcher(spawn, config, SizeOrTimeout(50, 0.05)) as batcher:
        yield batcher


def placements(batcher) -> list[str]:
    return [w.placement for w in batcher.pool.workers()]


async def remove(cluster, node) -> None:
    """Kill a raylet and wait until Ray has marked it dead (until then it may still place actors
    there, which die at once). Again for a node already killed (a test cut during the wait): only
    the wait, so the next test never places actors on it."""
    import ray

    if node in cluster.worker_nodes:
        cluster.remove_node(node, allow_graceful=False)
    def dead() -> bool:
        return not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id)

    await until_trio(dead, f"Ray marking node {node.node_id[:8]} dead", within=60)


def on(node) -> str:
    """The placement label of a worker on this raylet."""
    return f"ray:127.0.0.1:{node.node_id[:8]}"


async def test_fixed_mode_workers_in_ray_actors_answer_and_say_on_which_node_they_run(ray_cluster):
    async with batcher_of(fixed()) as batcher:
        inputs = [f"request {i}" for i in range(60)]
        assert await submit_all(batcher, inputs) == {text: text[::-1] for text in inputs}
        head = on(ray_cluster.head_node)
        assert placements(batcher) == [head, head]
        status = batcher.snapshot().status.workers
        assert [w.placement for w in status] == [head, head] and all(w.pid for w in status)
        assert batcher.counters.restarts == 0


async def test_an_actor_sigkilled_mid_batch_loses_no_request_and_is_replaced_by_a_new_actor():
    async with batcher_of(fixed(latency_ms=1000)) as batcher:
        inputs = [f"request {i}" for i in range(50)]
        programs = {w.slot: worker_program(w.pid) for w in batcher.pool.workers()}
        written = {slot: bytes_written(pid) for slot, pid in programs.items()}  # their ready frames
        outcome: dict = {}
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                outcome.update(await submit_all(batcher, inputs))

            nursery.start_soon(run)
            await until_trio(lambda: batcher.pool.busy_count == 1, "an actor's worker busy with the batch")
            (busy,) = [w for w in batcher.pool.workers() if w.state is SlotState.BUSY]
            await until_trio(lambda: bytes_written(programs[busy.slot]) > written[busy.slot],
                             "the busy worker's accepted frame: the call is its own")
            os.kill(busy.pid, signal.SIGKILL)  # the actor's, mid-call: its worker program goes with it
        await until_trio(lambda: batcher.pool.workers()[busy.slot].state is SlotState.IDLE,
                         "a new actor in the killed one's slot, idle")
        replaced = batcher.pool.workers()[busy.slot]
    assert outcome == {text: text[::-1] for text in inputs}
    assert (batcher.counters.restarts, batcher.counters.retries) == (1, 1)
    assert replaced.pid != busy.pid and replaced.restarts == 1 and replaced.placement.startswith("ray:")


async def test_a_frozen_actor_is_killed_after_the_hang_timeout_and_its_batch_answered_elsewhere():
    async with batcher_of(fixed(), hang_timeout=1.0) as batcher:
        frozen = batcher.pool.workers()[0]
        tree = process_tree(frozen.pid)
        for pid in tree:  # as a SIGSTOPped node: alive, connected, silent
            os.kill(pid, signal.SIGSTOP)
        try:
            inputs = [f"request {i}" for i in range(120)]
            assert await submit_all(batcher, inputs) == {text: text[::-1] for text in inputs}
            await until_trio(lambda: batcher.pool.workers()[0].state is SlotState.IDLE,
                             "the frozen actor's replacement idle")
        finally:
            for pid in tree:  # the worker program, orphaned by ray.kill, wakes to see it and exits
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert batcher.pool.workers()[0].pid != frozen.pid and batcher.counters.restarts == 1


async def test_a_node_removed_under_load_costs_no_request_and_its_workers_move_to_another_node(ray_cluster):
    doomed = ray_cluster.add_node(num_cpus=1, resources={"ferry_slot": 2})
    spare = None
    try:
        async with batcher_of(fixed(resources={"ferry_slot": 1}), hang_timeout=5.0) as batcher:
            assert placements(batcher) == [on(doomed)] * 2
            spare = ray_cluster.add_node(num_cpus=1, resources={"ferry_slot": 2})
            inputs = [f"request {i}" for i in range(400)]
            outcome: dict = {}
            async with trio.open_nursery() as nursery:
                async def wave(part: list[str]) -> None:
                    outcome.update(await submit_all(batcher, part))

                async def arrive() -> None:  # 400 requests over ~2 s: the node goes in the middle
                    for start in range(0, len(inputs), 20):
                        nursery.start_soon(wave, inputs[start:start + 20])
                        await trio.sleep(0.1)  # the load's pace: a wave of 20 every 0.1 s

                nursery.start_soon(arrive)
                await until_trio(lambda: batcher.counters.calls >= 2, "two calls answered on the doomed node")
                await remove(ray_cluster, doomed)
                doomed = None
            await until_trio(lambda: placements(batcher) == [on(spare)] * 2,
                             "both workers moved to the spare node", within=60)
        assert outcome == {text: text[::-1] for text in inputs}  # each answered, once, correctly
        assert batcher.counters.restarts >= 2
    finally:
        for node in (doomed, spare):
            if node is not None:
                await remove(ray_cluster, node)


@contextlib.asynccontextmanager
async def ray_engines(workers: int = 2):
    config = ContinuousModelConfig(name="ray-sim@1", simulated="llama-70b", workers=workers, placement="ray",
                                   num_blocks=64, max_batch_tokens=64, max_seqs=16)
    spawn = placed(config, [*config.engine_argv(), "--sim-eos-prob", "0"], EngineProcess)
    async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()) as pool:
        yield pool


async def test_an_engine_actor_sigkilled_mid_stream_ends_its_streams_with_an_error_and_reruns_the_rest():
    async with ray_engines() as pool:
        assert all(w.placement.startswith("ray:") for w in pool.snapshot().status.workers)
        streams = [Client() for _ in range(4)]
        wholes = [Client() for _ in range(4)]
        tickets = [pool.submit(job(i, 600, stream=True), c) for i, c in enumerate(streams)]
        tickets += [pool.submit(job(10 + i, 120, stream=False), c) for i, c in enumerate(wholes)]
        assert [t.replica for t in tickets] == [0, 1, 0, 1, 0, 1, 0, 1]
        await until_trio(lambda: all(c.delivered for c in streams), "text on every stream")
        os.kill(worker_pids(pool)[0], signal.SIGKILL)
        with trio.fail_after(60):
            for client in streams + wholes:
                await client.done.wait()
        for lost in streams[0::2]:
            failed = lost.events[-1]
            assert isinstance(failed, Failed) and isinstance(failed.error, ReplicaLost) and failed.retryable
            assert failed.tokens_sent == lost.delivered > 0
        assert all(isinstance(kept.events[-1], Finished) and kept.delivered == 600 for kept in streams[1::2])
        assert all([type(e) for e in w.events] == [Started, Delta, Finished] and len(w.text) == 120
                   for w in wholes)
        counters = pool.snapshot().counters
        assert (counters.reruns, counters.interrupted, counters.restarts) == (2, 2, 1)


async def test_a_model_asking_for_what_no_node_has_is_a_start_up_error_naming_the_model():
    no_node = (r"model 'ray-fixed@1': no node of the Ray cluster has "
               r"\{'GPU': 4, 'accelerator_type:H200': 0.001\}")
    with pytest.RaisesGroup(pytest.RaisesExc(WorkerStartError, match=no_node), flatten_subgroups=True):
        async with batcher_of(fixed(workers=1, num_gpus=4, accelerator_type="H200")):
            pass


@pytest.mark.skipif(not vllm_installed(), reason="vLLM's virtualenv .venv-vllm is not built (make vllm-env)")
async def test_a_ray_placed_worker_runs_under_the_interpreter_its_model_names():
    async with batcher_of(fixed(workers=1, python=str(VLLM_PYTHON))) as batcher:
        assert await submit_all(batcher, ["abc"]) == {"abc": "cba"}
        actor = batcher.snapshot().status.workers[0].pid  # the actor's: the program is its child
        children = (await trio.Path(f"/proc/{actor}/task/{actor}/children").read_text()).split()
        commands = [(await trio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0") for pid in children]
        assert [command[:3] for command in commands] == [[str(VLLM_PYTHON).encode(), b"-m", b"workers"]]
