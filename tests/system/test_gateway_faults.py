"""A real ``ferry serve`` under faults: a worker SIGKILLed under load costs no request;
SIGTERM lets the requests already in flight finish before the gateway and its workers exit,
and answers those stuck in a hung worker when the grace period ends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import aiohttp
import pytest

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import CONFIG, PAID, Gateway, message
from tests.support.processes import gone
from tests.support.waiting import until


async def offer(gateway: Gateway, count: int, rate: float, model: str = "sleepy") -> list[tuple[int, str]]:
    """``count`` requests at ``rate``/s, each on its own task; (status, text) of each, in order."""
    async with aiohttp.ClientSession(headers={"x-api-key": PAID}) as session:

        async def one(index: int) -> tuple[int, str]:
            await asyncio.sleep(index / rate)  # the load's pace: request ``index`` goes at index / rate
            async with session.post(
                f"{gateway.url}/v1/messages", json=message(f"r{index}", model=model)
            ) as reply:
                body = await reply.json()
                return reply.status, body["content"][0]["text"] if reply.status == 200 else str(body)

        return await asyncio.gather(*(one(index) for index in range(count)))


def stopped_in_a_call(gateway: Gateway) -> dict:
    """A worker frozen (SIGSTOP) while a call is its: busy in a /readyz taken after it stopped, so
    the kill that follows lands in the call, not in the moment after its answer."""
    while True:
        busy = gateway.wait_for(
            lambda models: any(w["state"] == "busy" for w in models["sleepy@1"]["workers"]),
            what="a busy worker",
        )
        victim = next(w for w in busy["sleepy@1"]["workers"] if w["state"] == "busy")
        os.kill(victim["pid"], signal.SIGSTOP)
        after = gateway.ready()["models"]["sleepy@1"]["workers"][victim["slot"]]
        if after["pid"] == victim["pid"] and after["state"] == "busy":
            return victim
        os.kill(victim["pid"], signal.SIGCONT)  # it answered before it stopped: take another


def test_a_worker_killed_under_load_fails_no_request(tmp_path):
    gateway = Gateway(tmp_path)
    try:
        async def main():
            load = asyncio.ensure_future(offer(gateway, 400, 400.0))
            victim = await asyncio.to_thread(stopped_in_a_call, gateway)
            os.kill(victim["pid"], signal.SIGKILL)
            return victim, await load

        victim, results = asyncio.run(asyncio.wait_for(main(), 60))
        assert [status for status, _ in results] == [200] * 400
        assert [text for _, text in results] == [f"User: r{i}"[::-1] for i in range(400)]
        sleepy = gateway.wait_for(
            lambda models: models["sleepy@1"]["workers"][victim["slot"]]["restarts"] == 1
        )
        # The batch it held went to another worker: retried, if the kill landed after the worker
        # accepted the call; re-sent uncounted, if the frame was still unread in its pipe (busy in
        # /readyz from dispatch on, a worker may be stopped before it reads the frame).
        handed_on = f"worker {victim['slot']} was gone before batch"
        assert sleepy["sleepy@1"]["retries"] >= 1 or handed_on in gateway.log.read_text()
        assert gone(victim["pid"])
    finally:
        assert gateway.stop() == 0


def test_sigterm_lets_in_flight_requests_finish_then_stops_the_workers(tmp_path):
    gateway = Gateway(tmp_path, CONFIG.replace("max_wait_ms = 20", "max_wait_ms = 1000"))
    workers = gateway.worker_pids()

    async def main():
        load = asyncio.ensure_future(offer(gateway, 30, 1000.0))
        await asyncio.to_thread(gateway.wait_for, lambda models: models["sleepy@1"]["queued"] == 30)
        gateway.process.send_signal(signal.SIGTERM)  # all 30 wait for the 1 s flush timer
        return await load

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert results == [(200, f"User: r{i}"[::-1]) for i in range(30)]
    assert gateway.process.wait(30) == 0
    said = gateway.process.stdout.read()  # type: ignore[union-attr]
    assert "draining in-flight requests" in said and "stopped" in said
    assert [pid for pid in workers if not gone(pid)] == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((gateway.host, gateway.port), timeout=5)
    gateway.stop()


def test_workers_that_cannot_start_stop_serve_with_the_reason(tmp_path):
    bad = CONFIG.replace('worker = ["echo", "--poison", "POISON"]', 'worker = ["no-such-model"]')
    said = (r"the scheduling core did not start: WorkerStartError: "
            r"echo@1: 2 of 2 workers did not start; first: worker 0: ")
    with pytest.raises(RuntimeError, match=said):
        Gateway(tmp_path, bad)


def test_a_fleet_that_crashes_on_every_call_answers_500_in_time_and_stays_not_ready(tmp_path):
    config = CONFIG.replace(
        "wait_budget_ms = 10000", "wait_budget_ms = 1000"
    ).replace(  # paid; hang_timeout 1 s
        'worker = ["echo", "--poison", "POISON"]', 'worker = ["echo", "--crash-on-call", "1"]'
    )
    gateway = Gateway(tmp_path, config)
    try:
        async def main():
            async with aiohttp.ClientSession(headers={"x-api-key": PAID}) as session:
                async def one(index: int) -> tuple[int, dict, float]:
                    started = asyncio.get_running_loop().time()
                    async with session.post(f"{gateway.url}/v1/messages", json=message(f"r{index}")) as reply:
                        return reply.status, await reply.json(), asyncio.get_running_loop().time() - started

                return await asyncio.gather(*(one(index) for index in range(20)))

        results = asyncio.run(asyncio.wait_for(main(), 60))
        # dispatched: 500 (it crashed every worker that took it); queued while every worker was
        # down: 529 (not dispatched within its budget)
        kinds = {(status, body["error"]["type"]) for status, body, _ in results}
        assert (500, "api_error") in kinds and kinds <= {(500, "api_error"), (529, "overloaded_error")}
        assert not any("pid" in body["error"]["message"] for _, body, _ in results)
        assert max(seconds for _, _, seconds in results) < 2.0 + 2.0  # budget + hang_timeout, + slack
        for _ in range(10):  # between crash cycles too: its workers restart, none has served
            status, _, body = gateway.request("GET", "/readyz")
            assert (status, body["models"]["echo@1"]["ready"]) == (503, False)
            time.sleep(0.1)  # the probes' pace: ten looks spread over a second of crash cycles
    finally:
        assert gateway.stop() == 0


HUNG = CONFIG.replace("shutdown_grace_ms = 10000", "shutdown_grace_ms = 2000") + """
[[models]]
name = "hung@1"
workers = 1
worker = ["echo", "--hang-on-call", "1"]
max_batch = 50
max_wait_ms = 1
hang_timeout_ms = 60000
"""


def test_sigterm_with_requests_stuck_in_a_hung_worker_drains_within_the_grace_and_answers_them(tmp_path):
    state = tmp_path / "state"
    gateway = Gateway(tmp_path, HUNG + f'\n[state]\ndir = "{state}"\n')
    answers: dict[int, bytes] = {}
    heard = threading.Semaphore(0)  # released by each stream once its first bytes arrive

    def send(index: int) -> None:  # even: streamed
        body = json.dumps(message(f"r{index}", model="hung@1", stream=index % 2 == 0)).encode()
        with socket.create_connection((gateway.host, gateway.port), timeout=30) as connection:
            connection.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
                               + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            first = connection.recv(65536)
            if index % 2 == 0:
                heard.release()
            answers[index] = first + b"".join(iter(lambda: connection.recv(65536), b""))

    clients = [threading.Thread(target=send, args=(index,)) for index in range(4)]
    for client in clients:
        client.start()
    gateway.wait_for(lambda models: models["hung@1"]["workers"][0]["state"] == "busy")
    for _ in range(2):  # the two streams have sent their headers (ping_interval_ms = 100)
        assert heard.acquire(timeout=10), "a stream sent no headers"
    began = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(30) == 0
    drain = time.monotonic() - began
    for client in clients:
        client.join()
    gateway.stop()
    assert drain < 2.0 + 1.5  # the grace, then the bounded answer window (it took twice the grace)
    said = (
        '{"type":"error","error":{"type":"overloaded_error",'
        '"message":"the server is shutting down: not done within 2000 ms"}}'
    )
    for index, answer in sorted(answers.items()):
        if index % 2:  # a whole request: its 503, with when to retry
            assert answer.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in answer
            assert answer.endswith(said.encode())
        else:  # a stream: its error event, then the end of the stream
            assert answer.startswith(b"HTTP/1.1 200 ") and b"event: message_start" in answer
            assert answer.endswith(b"event: error\ndata: " + said.encode() + b"\n\n\r\n0\r\n\r\n")
    assert len(answers) == 4
    records = read_usage(str(state / "usage.sqlite"))  # the status each client got, not 499
    assert sorted((r.status, r.outcome) for r in records) == [(200, "failed")] * 2 + [(503, "failed")] * 2


def test_readyz_says_not_ready_while_every_worker_of_a_model_is_hung_past_its_hang_timeout(tmp_path):
    gateway = Gateway(tmp_path, HUNG.replace("hang_timeout_ms = 60000", "hang_timeout_ms = 500"))
    try:
        assert gateway.request("GET", "/readyz")[0] == 200
        # the worker hangs on every call; the retries of the request's batch may run 1 s, then 2 s
        # (a batch that hung before), and past 0.5 s into each the worker counts as hung
        sent = threading.Thread(target=gateway.request,
                                args=("POST", "/v1/messages", message(model="hung@1")))
        sent.start()

        def hung() -> tuple[int, dict] | None:
            status, _, body = gateway.request("GET", "/readyz")
            return (status, body) if body["models"]["hung@1"]["workers"][0]["state"] == "hung" else None

        status, body = until(hung, "/readyz to show hung@1's worker hung")
        assert status == 503 and body["models"]["hung@1"]["ready"] is False
        assert body["error"]["message"] == "not ready: hung@1: every worker is hung past its hang timeout"
        sent.join()
    finally:
        assert gateway.stop() == 0
