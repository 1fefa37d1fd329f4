"""A user's own model behind ferry: classes written outside the repository (a temporary package)
named by import path, served by real worker processes over real HTTP through the Messages and
OpenAI chat routes, ``/v1/embeddings`` and the Open Inference Protocol; their crash, hang and
poison input handled as the built-in kinds' are; a model that cannot be built a start error
naming it; the model's ``warmup()`` before ``ready`` and ``close()`` at shutdown."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import math
import struct

import aiohttp
import openai
import pytest

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import FREE, PAID, Gateway
from tests.support.user_package import write_user_package
from tests.support.waiting import until

LIMITED = "sk-test-limited-0003"


def config(src, logs) -> str:
    return f"""
[server]
port = 0
max_body_bytes = 65536

[[tiers]]
name = "paid"
wait_budget_ms = 3000
[[tiers]]
name = "free"
wait_budget_ms = 300

[[keys]]
key = "{PAID}"
tenant = "acme"
tier = "paid"
[[keys]]
key = "{FREE}"
tenant = "acme"
tier = "free"
[[keys]]
key = "{LIMITED}"
tenant = "acme"
tier = "paid"
tokens_per_minute = 30

[[models]]
name = "shout@1"
aliases = ["shout"]
worker = "acme_models.serving:Shout"
pythonpath = ["{src}"]
worker_options = {{ suffix = "!", log_dir = "{logs}" }}
workers = 2
max_batch = 16
max_wait_ms = 20
hang_timeout_ms = 400

[[models]]
name = "embed@1"
aliases = ["embed"]
kind = "embedding"
dimensions = 4
shortenable = true
worker = "acme_models.serving:Embed"
pythonpath = ["{src}"]
worker_options = {{ log_dir = "{logs}" }}
workers = 1
max_batch = 64
max_wait_ms = 20
context_window = 64
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-model")
    src = write_user_package(root)
    gateway = Gateway(root, config(src, root / "logs"))
    yield gateway, root / "logs"
    if gateway.process.poll() is None:
        assert gateway.stop() == 0


def test_a_class_of_ones_own_answers_the_chat_routes_built_once_per_worker_with_its_device(served):
    gateway, logs = served
    status, _, reply = gateway.request("POST", "/v1/messages", {
        "model": "shout", "max_tokens": 100, "messages": [{"role": "user", "content": "hello"}]})
    assert (status, reply["content"][0]["text"], reply["model"]) == (200, "USER: HELLO!", "shout@1")
    chat = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=PAID, max_retries=0).chat.completions.create(
        model="shout", messages=[{"role": "user", "content": "device?"}])
    assert chat.choices[0].message.content == "cpu"  # the device keyword: no GPU on this machine
    warmed = sorted(path.name for path in logs.glob("warm-*"))
    assert len(warmed) == 2  # one warm-up per worker, before it said ready


def test_its_vectors_come_back_through_v1_embeddings_whole_shortened_or_in_base64(served):
    gateway, _ = served
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=PAID, max_retries=0)
    reply = client.embeddings.create(model="embed", input=["banana", "kiwi"], encoding_format="float")
    assert [d.embedding for d in reply.data] == [[6.0, 3.0, 1.0, 0.0], [4.0, 0.0, 1.0, 0.0]]
    assert (reply.model, reply.usage.prompt_tokens, reply.usage.total_tokens) == ("embed@1", 10, 10)
    short = client.embeddings.create(model="embed", input="aa", dimensions=2, encoding_format="float")
    assert short.data[0].embedding == pytest.approx([2 / math.sqrt(8), 2 / math.sqrt(8)])
    status, _, raw = gateway.request("POST", "/v1/embeddings", {"model": "embed", "input": "ab",
                                                                  "encoding_format": "base64"})
    assert status == 200
    assert struct.unpack("<4f", base64.b64decode(raw["data"][0]["embedding"])) == (2, 1, 1, 0)
    status, _, error = gateway.request("POST", "/v1/embeddings", {"model": "shout", "input": "x"})
    assert (status, error["error"]["param"]) == (400, "model")
    wide = {"model": "embed", "input": "x", "dimensions": 9}
    status, _, error = gateway.request("POST", "/v1/embeddings", wide)
    assert (status, error["error"]["message"]) == (400, "dimensions: expected 1..4 for embed@1, got 9")
    status, _, error = gateway.request("POST", "/v1/embeddings", {"model": "embed", "input": ["a" * 65]})
    assert status == 400 and "context window of 64" in error["error"]["message"]


def test_the_open_inference_protocol_serves_both_kinds_a_row_per_request(served):
    gateway, _ = served
    rows = {"name": "input", "datatype": "BYTES", "shape": [3], "data": ["a", "bb", "c"]}
    status, _, reply = gateway.request("POST", "/v2/models/shout/infer", {"id": "q1", "inputs": [rows]})
    assert status == 200 and reply == {
        "model_name": "shout@1", "model_version": "1", "id": "q1",
        "outputs": [{"name": "output", "datatype": "BYTES", "shape": [3], "data": ["A!", "BB!", "C!"]}]}
    status, _, reply = gateway.request("POST", "/v2/models/embed/versions/1/infer", {"inputs": [rows]})
    assert reply["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [3, 4],
                                 "data": [1, 1, 1, 0, 2, 0, 1, 0, 1, 0, 1, 0]}]
    status, _, metadata = gateway.request("GET", "/v2/models/embed")
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 4]}]
    assert gateway.request("GET", "/v2/models/shout@1/ready", key=None)[:3:2] == (200, {"name": "shout@1",
                                                                                       "ready": True})
    assert gateway.request("GET", "/v2/health/ready", key=None)[2] == {"ready": True}
    fp32 = {**rows, "datatype": "FP32", "data": [1.0, 2.0, 3.0]}
    status, _, error = gateway.request("POST", "/v2/models/embed/infer", {"inputs": [fp32]})
    assert (status, error) == (400, {"error": "inputs.0.datatype: expected 'BYTES' (text), got \"FP32\""})
    status, _, error = gateway.request("POST", "/v2/models/nope/infer", {"inputs": [rows]})
    assert status == 404 and error["error"].startswith("model: 'nope' is not served here")


def test_one_request_of_many_inputs_shares_batches_with_other_clients_and_waits_for_all(served):
    """Two clients' inputs ride the same calls: a request of 30 inputs and 10 single ones, sent
    together, take fewer calls than requests, and each answer holds its own inputs, in order."""
    gateway, _ = served
    before = gateway.ready()["models"]["embed@1"]["calls"]

    async def main():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {PAID}"}) as session:
            async def embed(inputs):
                async with session.post(f"{gateway.url}/v1/embeddings",
                                        json={"model": "embed", "input": inputs}) as reply:
                    return [d["embedding"][0] for d in (await reply.json())["data"]]

            return await asyncio.gather(embed(["a" * n for n in range(1, 31)]),
                                        *(embed(["b" * n]) for n in range(1, 11)))

    many, *singles = asyncio.run(main())
    assert many == list(range(1, 31)) and singles == [[n] for n in range(1, 11)]
    assert gateway.ready()["models"]["embed@1"]["calls"] - before < 11


def test_an_embedding_is_charged_its_input_tokens_once_and_idempotent_repeats_run_nothing(served):
    gateway, _ = served
    body = {"model": "embed", "input": ["x" * 20, "y" * 20]}
    status, headers, error = gateway.request("POST", "/v1/embeddings", body, key=LIMITED)
    assert (status, error["error"]["type"]) == (400, "invalid_request_error")  # 40 > 30 a minute: never
    one = {"model": "embed", "input": "x" * 20}
    status, headers, first = gateway.request("POST", "/v1/embeddings", one, key=LIMITED,
                                             headers={"Idempotency-Key": "k1"})
    assert status == 200
    status, again_headers, again = gateway.request("POST", "/v1/embeddings", one, key=LIMITED,
                                                   headers={"Idempotency-Key": "k1"})
    assert (status, again, again_headers["request-id"]) == (200, first, headers["request-id"])
    status, limited, error = gateway.request("POST", "/v1/embeddings", one, key=LIMITED)
    assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded") and "Retry-After" in limited
    records = until(lambda: [r for r in read_usage(str(gateway.tmp / "usage.sqlite"))
                             if r.request_id == headers["request-id"]], "the usage record")
    billed = [(r.model, r.input_tokens, r.output_tokens, r.status) for r in records]
    assert billed == [("embed@1", 20, 0, 200)]


def shout(gateway: Gateway, texts: list[str]) -> list[tuple[int, dict]]:
    """Each text as its own /v1/messages request, all at once; (status, body) of each, in order."""
    def send(text):
        status, _, body = gateway.request("POST", "/v1/messages", {
            "model": "shout", "max_tokens": 50, "messages": [{"role": "user", "content": text}]})
        return status, body

    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(send, texts))


def served_in_full(text: str) -> tuple[int, list]:
    return 200, [{"type": "text", "text": f"USER: {text.upper()}!"}]


@pytest.mark.parametrize(("marker", "told"), [("POISON", "the model raised ValueError"),
                                              ("CRASH", "a worker crashed")])
def test_its_crash_and_poison_input_fail_alone_and_its_batch_mates_are_served(served, marker, told):
    gateway, _ = served
    texts = [f"r{i}" for i in range(12)]
    texts[5] = f"r5 {marker}"
    for text, (status, body) in zip(texts, shout(gateway, texts), strict=True):
        if marker in text:
            assert status == 500 and told in body["error"]["message"], body
        else:
            assert (status, body.get("content")) == served_in_full(text), body
    gateway.wait_for(lambda models: models["shout@1"]["ready"], what="the fleet ready again")
    status, _, error = gateway.request("POST", "/v2/models/shout/infer", {"inputs": [
        {"name": "input", "datatype": "BYTES", "shape": [2], "data": ["fine", f"x {marker}"]}]})
    assert status == 500 and told in error["error"]  # the protocol's own shape, the same words


def test_its_hang_is_killed_and_answered_within_the_deadline_and_the_fleet_serves_on(served):
    """A call that hangs costs its worker (killed at the hang timeout, restarted); a request still
    unanswered at its tier's budget plus one hang timeout is a 500 (docs/fixed-mode.md: a hang's
    retries are bounded in time, so a hanging input's batch mates may share its fate)."""
    gateway, _ = served
    [(status, body)] = shout(gateway, ["r HANG"])
    assert status == 500 and "a worker hung" in body["error"]["message"], body
    gateway.wait_for(lambda models: models["shout@1"]["ready"], what="the fleet ready again")
    texts = [f"after {i}" for i in range(8)]
    assert [(status, body.get("content")) for status, body in shout(gateway, texts)] == [
        served_in_full(text) for text in texts]


def idle_shouters(models: dict) -> bool:
    return all(worker["state"] == "idle" for worker in models["shout@1"]["workers"])


def test_close_runs_at_shutdown_and_a_model_that_cannot_be_built_is_a_start_error_naming_it(tmp_path, served):
    gateway, logs = served
    shouting = gateway.wait_for(idle_shouters,
                                what="both Shout workers up and idle")
    alive = {f"closed-{w['pid']}" for w in shouting["shout@1"]["workers"]}
    assert gateway.stop() == 0
    assert alive <= {path.name for path in logs.glob("closed-*")}  # each closed its model as it stopped
    broken = config(tmp_path / "src", tmp_path / "logs").replace("serving:Embed", "serving:broken")
    write_user_package(tmp_path)
    with pytest.raises(RuntimeError) as failed:
        Gateway(tmp_path, broken)
    text = str(failed.value)
    assert "embed@1: 1 of 1 workers did not start" in text
    assert "could not build its model: RuntimeError: no weights at /models/x" in text
    assert "Traceback" in (tmp_path / "gateway.log").read_text()  # the log has it, never a client
