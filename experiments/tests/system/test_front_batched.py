"""T6's compiled front and the batched core answer the fixed route as ferry does: real workers
behind the trio core, real HTTP through the Rust front, frames over a real Unix socket
(experiments/docs/fixed-throughput.md). The front is built by hand (experiments/rust_front/build.sh),
not in CI: without its binary these tests are skipped."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from experiments.front_batched import FRONT
from experiments.http_load import ROOT
from experiments.tests.system.test_front_cpu import post

pytestmark = pytest.mark.skipif(not FRONT.exists(), reason="the Rust front is not built (its build.sh)")


@pytest.fixture(scope="module", params=["bridge", "none"])
def front(request):
    """``front_batched`` on the embedded default's fixed model, either hop to the core; its URL."""
    process = subprocess.Popen([sys.executable, "-m", "experiments.front_batched", "--hop", request.param],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert "listening on http://" in line, f"front_batched did not start: {line!r}"
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        process.terminate()
        process.wait(60)


def ask(url: str, content: str, headers: dict[str, str]) -> tuple[int, dict]:
    messages = [{"role": "user", "content": content}]
    body = json.dumps({"model": "ferry-fixed", "max_tokens": 64, "messages": messages})
    request = urllib.request.Request(f"{url}/v1/messages", body.encode(), headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, json.loads(reply.read())


def test_a_request_runs_on_a_worker_and_one_without_a_known_key_is_refused_by_the_front(front):
    status, answer = post(front, "sk-ferry-demo-paid")
    assert status == 200
    assert answer["content"][0]["text"] == "xof nworb kciuq eht :resU"  # the reference worker's answer
    assert answer["usage"]["input_tokens"] > 0
    assert post(front, None)[0] == 401
    assert post(front, "sk-not-a-key")[0] == 401


def test_concurrent_requests_each_get_their_own_answer(front):
    """Many requests ride in few frames both ways: each answer still reaches its own client."""
    headers = {"authorization": "Bearer sk-ferry-demo-free", "content-type": "application/json"}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda i: ask(front, f"request {i}", headers), range(120)))
    for i, (status, answer) in enumerate(replies):
        assert status == 200
        assert answer["content"][0]["text"] == f"User: request {i}"[::-1]


def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent(front):
    address = urllib.parse.urlsplit(front)
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        client.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: sk-ferry-demo-paid\r\n"
                       b"content-length: 100000000\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 413")
