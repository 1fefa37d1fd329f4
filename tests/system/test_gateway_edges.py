"""A real ``ferry serve`` at the edges of what a client may send: bodies that are not what their
``Content-Encoding`` says, a zip bomb, ``Expect: 100-continue`` with a body too large, and fields
whose meaning ferry would drop. Each answer is a 4xx in its route's error shape, with no
traceback in the log."""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import pytest

from tests.support.gateway_process import PAID, Gateway, message

ROUTES = {
    "/v1/messages": message("hi"),
    "/v1/messages/count_tokens": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "echo", "prompt": "hi"},
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = Gateway(tmp_path_factory.mktemp("gateway"))
    yield server
    assert server.stop() == 0


def error_of(path: str, body: dict) -> tuple[str, str]:
    """(type, message) of an error body in the route's shape: Anthropic's or OpenAI's."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        return body["error"]["type"], body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["type"], body["error"]["message"]


def no_traceback(gateway: Gateway) -> None:
    logged = gateway.log.read_text()
    assert "Traceback" not in logged and " ERROR " not in logged, logged[-2000:]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_is_not_the_encoding_it_declares_gets_400_in_its_routes_shape(gateway, path, encoding):
    plain = json.dumps(ROUTES[path]).encode()
    status, headers, body = gateway.request("POST", path, plain, {"Content-Encoding": encoding})
    assert status == 400
    said = f"body: not valid '{encoding}' data, as its Content-Encoding header declares"
    assert error_of(path, body) == ("invalid_request_error", said)
    assert headers["Connection"] == "close"  # what follows a body that cannot be read cannot be framed
    no_traceback(gateway)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_is_the_encoding_it_declares_is_served(gateway, encoding):
    plain = json.dumps(message("packed")).encode()
    packed = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    status, _, body = gateway.request("POST", "/v1/messages", packed, {"Content-Encoding": encoding})
    assert (status, body["content"][0]["text"]) == (200, "User: packed")


def peak_memory_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_a_zip_bomb_meets_max_body_bytes_not_the_gateways_memory(gateway):
    inflated = 256 << 20  # 256 MiB of a JSON string, sent as 250 KiB of gzip; the limit is 64 KiB
    bomb = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    head = b'{"model":"echo","max_tokens":5,"messages":[{"role":"user","content":"'
    packed = bomb.compress(head) + b"".join(bomb.compress(bytes(1 << 20)) for _ in range(inflated >> 20))
    packed += bomb.flush()
    before = peak_memory_kib(gateway.process.pid)
    status, _, body = gateway.request("POST", "/v1/messages", packed, {"Content-Encoding": "gzip"})
    assert (status, body["error"]["type"]) == (413, "request_too_large")
    assert peak_memory_kib(gateway.process.pid) - before < (inflated >> 10) // 4  # never inflated whole
    no_traceback(gateway)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_expect_100_continue_with_a_length_over_the_limit_gets_413_before_the_body(gateway, path):
    connection = socket.create_connection((gateway.host, gateway.port), timeout=10)
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nx-api-key: {PAID}\r\nExpect: 100-continue\r\n"
                       "Content-Length: 10000000\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = connection.recv(65536)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    connection.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head  # no 100 Continue first
    kind = "request_too_large" if path == "/v1/messages" else "invalid_request_error"  # OpenAI's code says it
    assert error_of(path, json.loads(body)) == (kind, "body: over the limit of 65536 bytes")


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/messages", "tools", [{"name": "weather", "input_schema": {"type": "object"}}]),
    ("/v1/messages", "tool_choice", {"type": "auto"}),
    ("/v1/messages", "thinking", {"type": "enabled", "budget_tokens": 1024}),
    ("/v1/messages/count_tokens", "tools", [{"name": "weather", "input_schema": {"type": "object"}}]),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "weather"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/completions", "echo", True),
])
def test_a_field_whose_meaning_ferry_would_drop_is_refused_naming_it(gateway, path, field, value):
    status, _, body = gateway.request("POST", path, {**ROUTES[path], field: value})
    assert status == 400
    kind, said = error_of(path, body)
    assert kind == "invalid_request_error" and said.startswith(f"{field}: not supported by this server, got ")
    if not path.startswith("/v1/messages"):
        assert body["error"]["param"] == field


UNUSED = {"tools": [], "tool_choice": "none"}
LEGACY_UNUSED = {"echo": False, "logprobs": None}  # the legacy route has no tools


@pytest.mark.parametrize("path", ROUTES)
def test_a_field_that_says_not_used_passes(gateway, path):
    unused = LEGACY_UNUSED if path == "/v1/completions" else UNUSED
    status, _, _ = gateway.request("POST", path, {**ROUTES[path], **unused})
    assert status == 200


def test_a_field_the_route_s_api_does_not_have_is_refused_even_empty(gateway):
    status, _, body = gateway.request("POST", "/v1/completions", {**ROUTES["/v1/completions"], **UNUSED})
    assert status == 400 and body["error"]["message"] == "tools: not supported by this server, got an array"
