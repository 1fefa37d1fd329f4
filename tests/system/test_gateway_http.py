"""A real ``ferry serve`` with real workers, over real HTTP: the anthropic SDK unchanged, every
error status from the table, keep-alive and pipelining, and a client that leaves mid-queue."""

from __future__ import annotations

import json
import socket
import threading

import anthropic
import pytest

from tests.support.gateway_process import FREE, PAID, Gateway, message
from tests.support.waiting import until


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    server = Gateway(tmp_path_factory.mktemp("gateway"))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=PAID, max_retries=0)


def test_the_sdk_creates_a_message_and_names_the_version(client):
    reply = client.messages.create(model="sleepy", max_tokens=100, system="be brief",
                                   messages=[{"role": "user", "content": "hello"}])
    prompt = "System: be brief\n\nUser: hello"
    assert reply.model == "sleepy@1" and reply.role == "assistant" and reply.type == "message"
    assert [block.text for block in reply.content] == [prompt[::-1]]
    assert reply.stop_reason == "end_turn"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(prompt), len(prompt))


def test_the_sdk_streams_a_message(client):
    with client.messages.stream(
        model="sleepy", max_tokens=5, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "olleh" and final.content[0].text == "olleh"
    assert (final.stop_reason, final.usage.output_tokens, final.model) == ("max_tokens", 5, "sleepy@1")


def test_the_sdk_sees_typed_errors(gateway, client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="echo", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    stranger = anthropic.Anthropic(base_url=gateway.url, api_key="sk-unknown-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model="echo", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert [model.id for model in client.models.list()] == ["sleepy@1", "echo@1", "held@1", "sleepy", "echo"]


def sse_events(raw: bytes) -> list[str]:
    return [line[7:] for line in raw.decode().split("\n") if line.startswith("event: ")]


def test_a_slow_stream_pings_while_it_waits_then_sends_the_events_in_order(gateway):
    connection = socket.create_connection((gateway.host, gateway.port))
    body = json.dumps(message("hi", model="sleepy", stream=True)).encode()
    connection.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: "
        + PAID.encode()
        + b"\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    raw = b"".join(iter(lambda: connection.recv(65536), b""))
    connection.close()
    head, _, stream = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    events = sse_events(stream)
    assert events[0] == "message_start" and events[1] == "ping"
    assert [e for e in events if e != "ping"] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(gateway):
    connection = socket.create_connection((gateway.host, gateway.port))
    body = json.dumps(message("late", model="held@1", stream=True)).encode()  # free tier: 300 ms budget
    connection.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: "
        + FREE.encode()
        + b"\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    raw = b"".join(iter(lambda: connection.recv(65536), b""))
    connection.close()
    head, _, stream = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = sse_events(stream)
    assert events[0] == "message_start" and events[-1] == "error" and set(events[1:-1]) == {"ping"}
    error = json.loads(stream.decode().rsplit("data: ", 1)[1].split("\n", 1)[0])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


ERRORS = [
    # (body, headers, key, status, error type, words in the message)
    (b"{not json", {}, PAID, 400, "invalid_request_error", "body"),
    (
        {"model": "echo", "messages": [{"role": "user", "content": "x"}]},
        {},
        PAID,
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    (message(max_tokens="10"), {}, PAID, 400, "invalid_request_error", "max_tokens"),
    (message(messages="hi"), {}, PAID, 400, "invalid_request_error", "messages"),
    (message("x" * 250, max_tokens=10), {}, PAID, 400, "invalid_request_error", "context window"),
    (message(stop_sequences=["x"] * 17), {}, PAID, 400, "invalid_request_error", "at most 16 stop sequences"),
    (message(), {}, None, 401, "authentication_error", "x-api-key"),
    (message(), {}, "sk-wrong-0000", 401, "authentication_error", "invalid"),
    (message(model="gpt-9"), {}, PAID, 404, "not_found_error", "gpt-9"),
    (b"x" * 70000, {}, PAID, 413, "request_too_large", "65536"),
    (message(model="held@1"), {}, FREE, 529, "overloaded_error", "not dispatched"),
    (message("POISON"), {}, PAID, 500, "api_error", "failed"),
]


@pytest.mark.parametrize(("body", "headers", "key", "status", "kind", "words"), ERRORS)
def test_every_error_has_its_status_and_the_error_body(gateway, body, headers, key, status, kind, words):
    got, response_headers, reply = gateway.request("POST", "/v1/messages", body, headers, key=key)
    assert (got, reply["type"], reply["error"]["type"]) == (status, "error", kind)
    assert words in reply["error"]["message"]
    assert ("Retry-After" in response_headers) == (status == 529)


def test_routes_and_methods_outside_the_api_answer_in_the_same_shape(gateway):
    assert gateway.request("GET", "/v3/nothing")[::2] == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "GET /v3/nothing: not found"}})
    # under /v2/, the Open Inference Protocol's own shape
    assert gateway.request("GET", "/v2/nothing")[::2] == (404, {"error": "GET /v2/nothing: not found"})
    status, _, reply = gateway.request("GET", "/v1/messages")
    assert (status, reply["error"]["type"]) == (405, "invalid_request_error")
    assert gateway.request("GET", "/healthz", key=None)[::2] == (200, {"status": "ok"})


def test_a_poison_input_fails_alone_and_its_batch_mates_succeed(gateway):
    results: dict[str, int] = {}

    def send(text: str) -> None:
        results[text] = gateway.request("POST", "/v1/messages", message(text))[0]

    threads = [threading.Thread(target=send, args=(text,)) for text in ["a", "b", "POISON c", "d"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {"a": 200, "b": 200, "POISON c": 500, "d": 200}


def test_the_bearer_header_and_the_free_tier_key_work(gateway):
    status, _, reply = gateway.request(
        "POST", "/v1/messages", message("abc"), {"Authorization": f"Bearer {FREE}"}, key=None
    )
    assert (status, reply["content"][0]["text"], reply["model"]) == (200, "User: abc", "echo@1")


def test_keep_alive_serves_many_requests_on_one_connection_and_pipelined_ones_in_order(gateway):
    import http.client

    connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=10)
    first_socket = None
    for index in range(3):
        connection.request("POST", "/v1/messages", json.dumps(message(f"m{index}")), {"x-api-key": PAID})
        response = connection.getresponse()
        assert json.loads(response.read())["content"][0]["text"] == f"User: m{index}"
        first_socket = first_socket or connection.sock
        assert connection.sock is first_socket
    connection.close()

    def post(text: str) -> bytes:
        body = json.dumps(message(text)).encode()
        return (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    raw = socket.create_connection((gateway.host, gateway.port), timeout=10)
    raw.sendall(post("one") + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n" + post("two"))
    received = b""
    while received.count(b"HTTP/1.1 200") < 3 or not received.endswith(b"}"):
        received += raw.recv(65536)
    raw.close()
    assert received.count(b"HTTP/1.1 200") == 3
    assert received.index(b"User: one") < received.index(b'"ok"') < received.index(b"User: two")


def test_a_client_that_leaves_mid_queue_takes_its_request_out_before_any_worker_sees_it(gateway):
    body = json.dumps(message("left", model="held@1")).encode()
    connection = socket.create_connection((gateway.host, gateway.port))
    connection.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: " + PAID.encode()
                       + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    gateway.wait_for(lambda models: models["held@1"]["queued"] == 1)
    connection.close()
    held = gateway.wait_for(lambda models: models["held@1"]["cancelled"] == 1)["held@1"]
    assert (held["queued"], held["flushed"], held["calls"]) == (0, 0, 0)
    until(lambda: gateway.metric("ferry_requests_total", absent=0, model="held@1", status="499") == 1,
          "the left request's end counted (499)")
    assert gateway.request("GET", "/healthz", key=None)[0] == 200


def test_aiohttp_limits_answer_oversized_headers_with_a_4xx(gateway):
    status = gateway.request("POST", "/v1/messages", message(), {"x-padding": "p" * 20000})[0]
    assert 400 <= status < 500
    many = {f"x-h{i}": "v" for i in range(200)}
    assert 400 <= gateway.request("POST", "/v1/messages", message(), many)[0] < 500
    assert gateway.request("GET", "/healthz", key=None)[0] == 200


@pytest.mark.parametrize(
    ("key", "first"), [(b"sk-wrong-key-0000", b"HTTP/1.1 401 "), (PAID.encode(), b"HTTP/1.1 100 ")]
)
def test_expect_100_continue_is_answered_only_after_the_key_is_checked(gateway, key, first):
    body = json.dumps(message("continued")).encode()
    connection = socket.create_connection((gateway.host, gateway.port), timeout=10)
    connection.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nx-api-key: "
        + key
        + b"\r\nExpect: 100-continue"
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    answer = connection.recv(65536)
    assert answer.startswith(first)
    if first == b"HTTP/1.1 401 ":  # refused before the body was asked for: it is never sent
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "authentication_error"
    else:
        connection.sendall(body)
        while not answer.endswith(b"}"):
            answer += connection.recv(65536)
        assert answer.split(b"\r\n\r\n", 1)[1].startswith(b"HTTP/1.1 200 ") and b"User: continued" in answer
    connection.close()
