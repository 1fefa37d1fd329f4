"""A real ``ferry serve`` against hostile connections, over real sockets: malformed requests that
carry a key and a prompt leave neither in the log, and the log lines they cost are bounded."""

from __future__ import annotations

import socket

from gateway.logs import BURST, Throttle
from tests.gateway_process import Gateway

SECRET = b"sk-secret-never-logged-9999"
PROMPT = b"a-private-prompt-never-logged"
MALFORMED = [  # (bytes sent, what the log line says was wrong)
    (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + SECRET + b"\x01\r\n\r\n", "Invalid header value char"),
    (b"POST /v1/messages HTTP/1.1\r\nx-api-key: " + SECRET + b"\r\nContent-Length: x" + PROMPT + b"\r\n\r\n",
     "Invalid character in Content-Length"),
    (b"POST /v1/messages HTTP/1.0\r\nx-api-key: " + SECRET + b"\r\n\r\n{\"messages\": \"" + PROMPT + b"\"}",
     "Data after `Connection: close`"),  # an HTTP/1.0 body with no length: aiohttp quoted it whole
    (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nX-" + b"a" * 9000 + b": " + SECRET + b"\r\n\r\n",
     "Got more than 8190 bytes when reading"),
    (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + PROMPT + b"\r\n0\r\n\r\n",
     "Invalid character in chunk size"),
]


def send(gateway: Gateway, data: bytes) -> bytes:
    with socket.create_connection((gateway.host, gateway.port), timeout=10) as connection:
        connection.sendall(data)
        return b"".join(iter(lambda: connection.recv(65536), b""))


def test_a_throttle_passes_a_burst_per_interval_and_counts_the_rest():
    now = [0.0]
    throttle = Throttle(interval=10.0, burst=2, clock=lambda: now[0])
    seen = []
    for at in (0.0, 1.0, 2.0, 3.0, 10.0, 10.5, 11.0, 25.0):
        now[0] = at
        seen.append(throttle.admit())
    assert seen == [0, 0, None, None, 2, 0, None, 1]


def test_malformed_requests_leave_no_key_or_prompt_in_the_log_and_a_bounded_line_each(tmp_path):
    gateway = Gateway(tmp_path)
    try:
        answers = [send(gateway, data) for data, _ in MALFORMED]
        for _ in range(3 * BURST):  # a flood of them costs at most BURST lines per interval
            send(gateway, MALFORMED[0][0])
        assert gateway.request("GET", "/healthz", key=None)[0] == 200
    finally:
        assert gateway.stop() == 0
    assert all(answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0] for answer in answers)
    log = gateway.log.read_bytes()
    assert SECRET not in log and PROMPT not in log and b"Traceback" not in log
    lines = [line for line in log.decode().splitlines() if "Error handling request" in line]
    assert all(" WARNING Error handling request from 127.0.0.1: " in line for line in lines)
    assert [line.split("127.0.0.1: ", 1)[1] for line in lines[: len(MALFORMED)]] == [
        f"{what} (400)" for _, what in MALFORMED
    ]
    assert len(lines) == BURST
