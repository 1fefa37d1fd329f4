"""The front prototype answers the fixed route as ferry does: real workers behind the trio core,
real HTTP, its own process (what experiments/docs/fixed-throughput.md measured)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from experiments.http_load import ROOT

BODY = json.dumps({"model": "ferry-fixed", "max_tokens": 64,
                   "messages": [{"role": "user", "content": "the quick brown fox"}]}).encode()


def post(url: str, key: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json", **({"x-api-key": key} if key else {})}
    request = urllib.request.Request(f"{url}/v1/messages", BODY, headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@pytest.fixture
def front():
    """``front_cpu --front aiohttp`` on the embedded default's fixed model; its URL."""
    process = subprocess.Popen([sys.executable, "-m", "experiments.front_cpu", "--front", "aiohttp"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert "listening on http://" in line, f"front_cpu did not start: {line!r}"
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        process.terminate()
        process.wait(60)


def test_the_prototype_runs_a_request_on_a_worker_and_refuses_one_without_a_key(front):
    status, answer = post(front, "sk-ferry-demo-paid")
    assert status == 200
    assert answer["content"][0]["text"] == "xof nworb kciuq eht :resU"  # the reference worker's answer
    assert answer["usage"]["input_tokens"] > 0
    assert post(front, None) == (401, {"type": "error"})
