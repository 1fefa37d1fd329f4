"""A real ``ferry serve``, and clients that leave while their whole answer is being written.

300 whole requests fill one batch of a 300 ms worker; their clients then close their
connections one after another across the moment the batch's answers come back. Whoever left
before the answer was written is recorded as a client that left (499, ``cancelled``, no output
billed), whoever stayed as answered (200, ``completed``): never a 500, a ``failed`` outcome or a
traceback, however a close falls against the write.

When each close falls is not asserted (the spread only makes some of them fall while answers
are written, as under real traffic); what is asserted holds for every close.
"""

from __future__ import annotations

import json
import socket
import time

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import CONFIG, PAID, Gateway
from tests.support.waiting import until

CLIENTS = 300
CALL_MS = 300
LEAVING = f"""
[[models]]
name = "slow@1"
workers = 1
worker = ["sleep", "--latency-ms", "{CALL_MS}"]
max_batch = {CLIENTS}
max_wait_ms = 60000
"""


def request(index: int) -> bytes:
    body = json.dumps({"model": "slow@1", "max_tokens": 50,
                       "messages": [{"role": "user", "content": f"r{index}"}]}).encode()
    return (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_clients_that_leave_while_their_whole_answers_are_written_are_recorded_as_leaving(tmp_path):
    gateway = Gateway(tmp_path, CONFIG + LEAVING)
    try:
        clients = [socket.create_connection((gateway.host, gateway.port), timeout=10) for _ in range(CLIENTS)]
        for index, client in enumerate(clients):
            client.sendall(request(index))  # the last one fills the batch: it is sent to the worker
        # polled without pause: the moment the call began sets when the answers are due
        until(lambda: gateway.ready()["models"]["slow@1"]["workers"][0]["state"] == "busy",
              "the full batch on the worker", every=0)
        flushed = time.monotonic()
        for index, client in enumerate(clients):  # closes spread across the moment the answers are due
            leave_at = flushed + CALL_MS / 1000 * (0.85 + 0.3 * index / CLIENTS)
            time.sleep(max(0.0, leave_at - time.monotonic()))  # the closes' pace, not a wait for anything
            client.shutdown(socket.SHUT_WR)
            client.close()
        gateway.wait_for(lambda models: models["slow@1"]["queued"] == 0 and
                         models["slow@1"]["workers"][0]["state"] == "idle")
    finally:
        assert gateway.stop() == 0
    records = [r for r in read_usage(str(tmp_path / "usage.sqlite")) if r.model == "slow@1"]
    assert len(records) == CLIENTS
    seen = {(r.status, r.outcome) for r in records}
    assert seen <= {(200, "completed"), (499, "cancelled")}, seen
    assert all(r.output_tokens == 0 for r in records if r.status == 499)
    logged = gateway.log.read_text()
    assert "Traceback" not in logged and "Error handling request" not in logged
