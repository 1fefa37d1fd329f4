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


def start(*argv: str) -> tuple[subprocess.Popen, str]:
    """``front_batched`` on the embedded default's fixed model with ``argv``; its URL."""
    process = subprocess.Popen([sys.executable, "-m", "experiments.front_batched", *argv],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # type: ignore[union-attr]
    assert "listening on http://" in line, f"front_batched did not start: {line!r}"
    return process, line.rsplit(" ", 1)[1].strip()


@pytest.fixture(scope="module", params=["bridge", "none"])
def front(request):
    process, url = start("--hop", request.param)
    try:
        yield url
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


@pytest.mark.parametrize("hop", ["bridge", "none"])
def test_a_client_that_goes_away_before_its_answer_has_its_job_cancelled(hop):
    """Each connection closes once the core has taken its request (the trace's line), which then
    waits 150 ms for a batch with none other queued: the front tells the core, which takes the
    job back (its stop report counts it)."""
    process, url = start("--hop", hop, "--trace")
    try:
        address = urllib.parse.urlsplit(url)
        messages = [{"role": "user", "content": "x"}]
        body = json.dumps({"model": "ferry-fixed", "max_tokens": 8, "messages": messages})
        for _ in range(3):
            with socket.create_connection((address.hostname, address.port), timeout=30) as client:
                client.sendall(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: sk-ferry-demo-paid\r\n"
                               f"content-length: {len(body)}\r\n\r\n{body}".encode())
                while "took" not in process.stderr.readline():  # type: ignore[union-attr]
                    pass
        assert post(url, "sk-ferry-demo-paid")[0] == 200  # the core is still serving
    finally:
        process.terminate()
        _, report = process.communicate(timeout=60)
    assert "4 requests" in report and "3 cancelled" in report, report


def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent(front):
    address = urllib.parse.urlsplit(front)
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        client.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: sk-ferry-demo-paid\r\n"
                       b"content-length: 100000000\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 413")
