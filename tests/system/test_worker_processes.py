"""The pool over real `python -m workers` processes: kills, hangs, chatter, poison, torch.

These use the real clock (subprocess I/O does not run under MockClock); every bound is generous
and nothing asserts speed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import socket
import struct
import subprocess
import sys

import pytest
import trio

from batcher.core.config import PoolConfig
from batcher.core.errors import RequestFailed
from batcher.core.supervisor import WorkerStartError
from batcher.fixed.batcher import open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.slot import SlotState
from batcher.fixed.worker import ProcessWorker
from batcher.placement.local import process_workers
from tests.support.fixed_batcher import submit_all
from tests.support.processes import alive, bytes_written
from tests.support.waiting import until_trio
from workers.protocol import NotDelivered, Ready, Result, RunBatch, WorkerLost, encode

LATENCY = ["sleep", "--latency-ms", "100"]


def per_slot(argv_by_slot: dict[int, list[str]], default: list[str] = LATENCY):
    """A Spawn giving some slots their own worker argv (e.g. a fault plan)."""

    def spawn(slot: int) -> ProcessWorker:
        return ProcessWorker(argv_by_slot.get(slot, default), dict(os.environ))

    return spawn


@contextlib.asynccontextmanager
async def pool_of(spawn, workers: int = 2, hang_timeout: float = 5.0):
    config = PoolConfig(workers=workers, hang_timeout=hang_timeout)
    async with open_batcher(spawn, config, SizeOrTimeout(50, 0.05)) as batcher:
        yield batcher


async def test_sigkill_of_a_worker_mid_batch_loses_no_request():
    spawn = process_workers(["sleep", "--latency-ms", "1000"], workers=2, kind=ProcessWorker)
    inputs = [f"request {i}" for i in range(50)]
    async with pool_of(spawn) as batcher:
        written = {w.slot: bytes_written(w.pid) for w in batcher.pool.workers()}  # their ready frames
        async with trio.open_nursery() as nursery:
            outcome = {}

            async def run() -> None:
                outcome.update(await submit_all(batcher, inputs))

            nursery.start_soon(run)
            await until_trio(lambda: batcher.pool.busy_count == 1, "a worker busy with the batch")
            (busy,) = [w for w in batcher.pool.workers() if w.state is SlotState.BUSY]
            await until_trio(lambda: bytes_written(busy.pid) > written[busy.slot],
                             "the busy worker's accepted frame: the call is its own")
            os.kill(busy.pid, signal.SIGKILL)  # inside the 1 s call
        replaced = batcher.pool.workers()[busy.slot]
    assert outcome == {text: text[::-1] for text in inputs}
    assert (batcher.counters.restarts, batcher.counters.retries) == (1, 1)
    assert replaced.pid != busy.pid and replaced.restarts == 1


async def test_a_hung_worker_is_killed_and_replaced():
    spawn = per_slot({0: [*LATENCY, "--hang-on-call", "1"]})
    async with pool_of(spawn, hang_timeout=1.0) as batcher:
        hung_pid = batcher.pool.workers()[0].pid
        results = await submit_all(batcher, ["a", "b", "c"])
        await until_trio(lambda: batcher.pool.workers()[0].state is SlotState.IDLE,
                         "the hung worker's replacement idle")
        replacement = batcher.pool.workers()[0]
        assert not alive(hung_pid)
        assert replacement.pid != hung_pid and alive(replacement.pid)
    assert results == {"a": "a", "b": "b", "c": "c"}
    assert (batcher.counters.restarts, batcher.counters.retries) == (1, 1)


async def test_a_fleet_whose_every_worker_up_is_hung_is_not_ready_before_supervision_kills_it():
    # slot 0 hangs on the call and is killed at the hang timeout, then waits a minute to restart;
    # slot 1 takes the retry, which may run twice as long (a batch that hung before), and hangs too
    config = PoolConfig(workers=2, hang_timeout=1.0, restart_backoff=60.0, max_restart_backoff=60.0)
    spawn = process_workers(["echo", "--hang-on-call", "1"], 2, kind=ProcessWorker)
    async with open_batcher(spawn, config, SizeOrTimeout(1, 0.0)) as batcher:
        retried_on = batcher.pool.workers()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit_all, batcher, ["a"])
            await until_trio(lambda: not batcher.pool.ready, "the pool not ready, every worker up hung")
            states = [(info.state, info.pid) for info in batcher.pool.workers()]
            nursery.cancel_scope.cancel()
    assert states == [(SlotState.STARTING, states[0][1]), (SlotState.HUNG, retried_on.pid)]  # not yet killed
    assert batcher.counters.retries == 1


async def test_a_worker_that_prints_to_stdout_does_not_corrupt_the_protocol(capfd):
    spawn = process_workers([*LATENCY, "--chatter"], workers=1, kind=ProcessWorker)
    inputs = [f"chatty {i}" for i in range(20)]
    async with pool_of(spawn, workers=1) as batcher:
        first = await submit_all(batcher, inputs[:10])
        second = await submit_all(batcher, inputs[10:])
    assert {**first, **second} == {text: text[::-1] for text in inputs}
    assert batcher.counters.restarts == 0
    assert "chatter: call 2 with 10 inputs" in capfd.readouterr().err


async def test_one_poison_input_fails_alone_across_real_processes():
    spawn = process_workers([*LATENCY, "--poison", "☠"], workers=2, kind=ProcessWorker)
    inputs = [f"request {i}" for i in range(20)]
    inputs[13] = "request 13 ☠"
    async with pool_of(spawn) as batcher:
        results = await submit_all(batcher, inputs)
    assert isinstance(results.pop("request 13 ☠"), RequestFailed)
    assert results == {text: text[::-1] for text in inputs if "☠" not in text}
    assert batcher.counters.restarts == 0


async def test_a_worker_that_exits_on_a_call_has_its_batch_retried_elsewhere():
    spawn = per_slot({0: [*LATENCY, "--crash-on-call", "1"]})
    async with pool_of(spawn) as batcher:
        results = await submit_all(batcher, ["x", "y"])
    assert results == {"x": "x", "y": "y"}
    assert (batcher.counters.restarts, batcher.counters.retries) == (1, 1)


BAD = ["no-such-kind"]


@pytest.mark.parametrize(("bad", "workers", "failed"),
                         [({0: BAD, 1: BAD}, 2, "2 of 2"), ({1: BAD}, 3, "1 of 3")])
async def test_workers_that_cannot_start_fail_the_pool_start_with_one_error(bad, workers, failed):
    first = min(bad)  # every failure is waited for: the lowest failed slot's reason, whichever died first
    reason = rf"bad@1: {failed} workers did not start; first: worker {first}: WorkerLost\('pid \d+ exited"
    with pytest.RaisesGroup(pytest.RaisesExc(WorkerStartError, match=reason), flatten_subgroups=True):
        async with open_batcher(per_slot(bad), PoolConfig(workers=workers, model="bad@1")):
            pass  # pragma: no cover - never reached


async def test_the_torch_worker_labels_each_input_the_same_in_any_batch():
    worker = ProcessWorker(["classify", "--dim", "64", "--layers", "2"], dict(os.environ))
    inputs = ["", "a", "hello world", "ü" * 300, *(f"input number {i}" for i in range(16))]
    try:
        with trio.fail_after(120):
            await worker.start()
            together = await worker.call(RunBatch(1, inputs))
            alone = [await worker.call(RunBatch(2 + i, [text])) for i, text in enumerate(inputs)]
    finally:
        await worker.stop()
    assert isinstance(together, Result) and worker.model.startswith("classify-d64-l2-")
    assert together.outputs == [reply.outputs[0] for reply in alone]
    assert len(set(together.outputs)) > 1


async def test_a_worker_stuck_in_a_call_exits_when_its_parent_dies(tmp_path):
    pid_file = tmp_path / "worker.pid"
    parent = (  # start a worker, make it hang in a call (so it never reads EOF), then exit
        "import subprocess, sys; from workers.protocol import RunBatch, encode;"
        "p = subprocess.Popen([sys.executable, '-m', 'workers', 'sleep', '--hang-on-call', '1'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE);"
        "p.stdout.read(1); p.stdin.write(encode(RunBatch(1, ['x']))); p.stdin.flush();"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    await trio.run_process([sys.executable, "-c", parent])
    worker_pid = int(pid_file.read_text())
    await until_trio(lambda: not alive(worker_pid), "the orphaned worker's exit", within=10)


async def test_each_start_of_a_slot_draws_its_own_crash_schedule():
    spawn = process_workers(["echo", "--crash-prob", "0.3", "--seed", "1"], workers=1, kind=ProcessWorker)

    async def calls_until_crash() -> int:
        worker = spawn(0)
        try:
            await worker.start()
            for call in itertools.count(1):
                try:
                    await worker.call(RunBatch(call, ["x"]))
                except WorkerLost:
                    return call
        finally:
            await worker.stop()

    with trio.fail_after(60):
        crashed_on = [await calls_until_crash() for _ in range(3)]
    # the seed alone would crash every start on its first call, a 100 % rate for 30 % asked
    assert crashed_on == [9, 3, 4]  # FaultInjector(plan, "0:1"), "0:2", "0:3": a rerun repeats them


async def test_workers_killed_while_idle_are_replaced_before_any_traffic():
    async with pool_of(process_workers(LATENCY, workers=8, kind=ProcessWorker), workers=8) as batcher:
        killed = [info.pid for info in batcher.pool.workers()]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        await until_trio(lambda: all(info.restarts == 1 and info.state is not SlotState.STARTING
                                     for info in batcher.pool.workers()),
                         "every killed worker replaced", within=10)
        replacements = [info.pid for info in batcher.pool.workers()]
        assert batcher.counters.flushed_requests == 0  # noticed by watching the processes, not by a call
        assert not set(replacements) & set(killed) and all(alive(pid) for pid in replacements)
        # every slot lost its worker: not ready until one serves, and a probe call proves one
        # does, without traffic (a load balancer sends none to a gateway that is not ready)
        await until_trio(lambda: batcher.pool.ready, "the pool ready again after its probe call", within=10)
        assert batcher.counters.probes == 1 and batcher.counters.calls == 1
        assert await batcher.answer("hello", "paid") == "olleh"


async def test_a_request_after_the_lowest_idle_workers_were_killed_is_served_first_time():
    spawn = process_workers(LATENCY, workers=8, kind=ProcessWorker)
    config = PoolConfig(workers=8, max_attempts=1)  # a single lost call would fail the input
    async with open_batcher(spawn, config, SizeOrTimeout(1, 0.0)) as batcher:
        for info in batcher.pool.workers()[:3]:
            os.kill(info.pid, signal.SIGKILL)
        with trio.fail_after(10):
            assert await batcher.answer("hello", "paid") == "olleh"
    assert (batcher.counters.retries, batcher.counters.failed_inputs) == (0, 0)


async def test_a_call_to_a_worker_already_dead_is_not_delivered():
    worker = ProcessWorker(LATENCY, dict(os.environ))
    try:
        with trio.fail_after(30):
            await worker.start()
            os.kill(worker.pid, signal.SIGKILL)
            await worker.wait_exit()
            with pytest.raises(NotDelivered, match="pipe closed"):
                await worker.call(RunBatch(1, ["x"]))
    finally:
        await worker.stop()


async def test_a_garbage_frame_is_a_protocol_fault_and_only_the_named_slot_misbehaves():
    """--garbage-on-call answers with bytes no decoder accepts; --only-slot keeps the other
    slots healthy: the batch is retried elsewhere and every request is answered."""
    spawn = process_workers(["echo", "--garbage-on-call", "1", "--only-slot", "0"], 2, kind=ProcessWorker)
    async with open_batcher(spawn, PoolConfig(workers=2), SizeOrTimeout(1, 0.0)) as batcher:
        answers = [await batcher.answer(f"r{i}", "paid") for i in range(4)]
        retries = batcher.counters.retries
        restarts = {worker.slot: worker.restarts for worker in batcher.pool.workers()}
    assert answers == [f"r{i}" for i in range(4)]
    assert retries >= 1  # slot 0's first call broke the protocol: its batch went to slot 1
    assert restarts[1] == 0  # slot 1 never misbehaved


def test_a_fixed_mode_worker_starts_without_importing_an_engine():
    """A restarted fixed-mode worker is what a fleet whose workers all failed waits for: its
    start-up imports neither engine (their scheduler, model code, numpy: two thirds of it)."""
    probe = (
        "import sys, workers.__main__ as main; main.build_parser().parse_args(['sleep']); "
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('numpy', 'torch', 'vllm') "
        "or name in ('workers.engine.engine', 'workers.engine.serve', 'workers.vllm_engine')))"
    )
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"
    engine = subprocess.run(
        [sys.executable, "-c", "import workers.__main__ as main; main.build_parser().parse_args("
         "['engine', '--simulated', 'llama-70b'])"], capture_output=True, text=True)
    assert engine.returncode == 0, engine.stderr  # the engine kinds still parse their command lines


class TcpWorker(ProcessWorker):
    """A fixed-mode worker at the far end of a TCP connection, as a Ray-placed one is."""

    def __init__(self, port: int) -> None:
        super().__init__(LATENCY, {})
        self._port = port

    async def _launch(self) -> None:
        self._to_worker = self._from_worker = await trio.open_tcp_stream("127.0.0.1", self._port)

    async def _lost(self) -> str:
        return "connection ended"

    async def stop(self, grace: float = 0.0) -> None:
        await self._from_worker.aclose()


async def test_a_worker_whose_connection_is_reset_mid_call_is_lost_not_an_error_of_its_pool():
    """A node that goes away resets its workers' connections (no EOF): the call ends as a lost
    worker, which the pool retries elsewhere, not as an exception out of the pool."""

    async def host(stream: trio.SocketStream) -> None:
        await stream.send_all(encode(Ready(pid=1, model="tcp")))
        await stream.receive_some(1 << 16)  # the call
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # closed with linger 0: an RST

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, host, 0, host="127.0.0.1"))
        worker = TcpWorker(listeners[0].socket.getsockname()[1])
        await worker.start()
        with pytest.raises(WorkerLost, match="connection ended"):
            await worker.call(RunBatch(id=1, inputs=["x"]))
        await worker.stop()
        nursery.cancel_scope.cancel()
