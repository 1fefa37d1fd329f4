"""A real ``ferry serve`` against hostile connections, over real sockets: malformed requests that
carry a key and a prompt leave neither in the log, and the log lines they cost are bounded; half
sent headers, trickled bodies and idle keep-alives are closed at their deadlines; a crowd of held
connections past the cap makes room for /healthz, and a full house of requests gets a 503."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from gateway.logs import BURST, Throttle
from tests.support.gateway_process import CONFIG, PAID, Gateway, message
from tests.support.waiting import until

SECRET = b"sk-secret-never-logged-9999"
PROMPT = b"a-private-prompt-never-logged"
MALFORMED = [  # (bytes sent, what the log line says was wrong)
    (
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + SECRET + b"\x01\r\n\r\n",
        "Invalid header value char",
    ),
    (
        b"POST /v1/messages HTTP/1.1\r\nx-api-key: "
        + SECRET
        + b"\r\nContent-Length: x"
        + PROMPT
        + b"\r\n\r\n",
        "Invalid character in Content-Length",
    ),
    (
        b"POST /v1/messages HTTP/1.0\r\nx-api-key: " + SECRET + b'\r\n\r\n{"messages": "' + PROMPT + b'"}',
        "Data after `Connection: close`",
    ),  # an HTTP/1.0 body with no length: aiohttp quoted it whole
    (
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nX-" + b"a" * 9000 + b": " + SECRET + b"\r\n\r\n",
        "Got more than 8190 bytes when reading",
    ),
    (
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + PROMPT
        + b"\r\n0\r\n\r\n",
        "Invalid character in chunk size",
    ),
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
    assert all(
        answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0] for answer in answers
    )
    log = gateway.log.read_bytes()
    assert SECRET not in log and PROMPT not in log and b"Traceback" not in log
    lines = [line for line in log.decode().splitlines() if "Error handling request" in line]
    assert all(" WARNING Error handling request from 127.0.0.1: " in line for line in lines)
    assert [line.split("127.0.0.1: ", 1)[1] for line in lines[: len(MALFORMED)]] == [
        f"{what} (400)" for _, what in MALFORMED
    ]
    assert len(lines) == BURST


TIMEOUTS = CONFIG.replace("shutdown_grace_ms = 10000\n", """shutdown_grace_ms = 10000
header_timeout_ms = 500
body_timeout_ms = 500
idle_timeout_ms = 1500
""")
CAPPED = CONFIG.replace("shutdown_grace_ms = 10000\n", "shutdown_grace_ms = 10000\nmax_connections = 5\n")


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory):
    server = Gateway(tmp_path_factory.mktemp("timeouts"), TIMEOUTS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    server = Gateway(tmp_path_factory.mktemp("capped"), CAPPED)
    yield server
    assert server.stop() == 0


def received_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (10 s at most)."""
    connection.settimeout(10)
    return b"".join(iter(lambda: connection.recv(65536), b""))


def test_half_sent_headers_and_silent_connections_are_closed_at_the_header_timeout(timeouts):
    before = timeouts.metric("ferry_connections_closed_total", reason="header_timeout")
    loris = socket.create_connection((timeouts.host, timeouts.port))
    loris.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode() + b"\r\nContent-Le")
    silent = socket.create_connection((timeouts.host, timeouts.port))
    assert received_until_closed(loris) == b"" and received_until_closed(silent) == b""
    assert timeouts.metric("ferry_connections_closed_total", reason="header_timeout") == before + 2


def test_a_body_trickled_one_byte_at_a_time_gets_408_and_the_connection_closes(timeouts):
    body = json.dumps(message("trickled")).encode()
    connection = socket.create_connection((timeouts.host, timeouts.port))
    connection.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
                       + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    connection.settimeout(0.05)
    answer = b""
    for byte in body:  # one byte each 50 ms: the whole body would take seconds
        connection.sendall(bytes([byte]))
        with contextlib.suppress(TimeoutError):
            answer += connection.recv(65536)
        if answer:
            break
    answer += received_until_closed(connection)
    head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply) == {"type": "error", "error": {
        "type": "timeout_error", "message": "body: not received within 500 ms of the headers"}}
    assert timeouts.metric("ferry_connections_closed_total", reason="body_timeout") >= 1


def test_an_idle_keep_alive_connection_is_closed_at_the_idle_timeout_not_before(timeouts):
    connection = socket.create_connection((timeouts.host, timeouts.port))
    connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    answered = time.monotonic()
    first = connection.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b'{"status": "ok"}')
    assert received_until_closed(connection) == b""
    assert time.monotonic() - answered >= 1.0  # idle (1.5 s), not the header deadline (0.5 s)


def test_connections_held_past_the_cap_make_room_and_healthz_still_answers(capped):
    held = []
    for _ in range(300):  # a slow-loris crowd: each sends half its headers and waits
        connection = socket.create_connection((capped.host, capped.port))
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        held.append(connection)
    try:
        answers: list[int] = []

        def answered() -> bool:  # 503 while the crowd is under a second old
            answers.append(capped.request("GET", "/healthz", key=None)[0])
            return answers[-1] != 503

        until(answered, "/healthz to answer past the crowd", within=10)
        assert set(answers) <= {200, 503} and answers[-1] == 200
        assert [capped.request("GET", "/healthz", key=None)[0] for _ in range(3)] == [200] * 3
        assert received_until_closed(held[0]) == b""  # the oldest made room first
        open_now = sum(capped.metric("ferry_connections", phase=p) for p in ("awaiting", "busy", "idle"))
        assert open_now <= 5
        shed = sum(capped.metric("ferry_connections_closed_total", reason=r) for r in ("evicted", "refused"))
        assert shed >= 300 - 5  # all the crowd but the cap's worth: refused young, or closed for room
    finally:
        for connection in held:
            connection.close()


def test_when_every_connection_runs_a_request_a_newcomer_gets_a_503_in_the_error_shape(capped):
    body = json.dumps(message("held", model="held@1")).encode()
    held = []
    for _ in range(5):
        connection = socket.create_connection((capped.host, capped.port))
        connection.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
                           + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        held.append(connection)
    try:

        def refused() -> tuple | None:  # once all five are queued in the core
            answer = capped.request("GET", "/healthz", key=None)
            return answer if answer[0] != 200 else None

        status, headers, reply = until(refused, "every connection held by a request", within=10)
    finally:
        for connection in held:
            connection.close()
    assert (status, headers["Retry-After"], headers["Connection"]) == (503, "1", "close")
    assert reply == {"type": "error", "error": {
        "type": "overloaded_error", "message": "the gateway holds its limit of 5 connections"}}
    capped.wait_for(lambda models: models["held@1"]["cancelled"] == 5)  # they left: room again
