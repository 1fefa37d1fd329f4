"""The KV hand-off between Ray actors: ``ferry serve`` with SmolLM2-135M (float32, one thread an
engine) as one colocated local replica (``colocated@1``) and as one prefill and one decode replica
placed on the session's loopback Ray cluster (``apart@1``). Each engine runs in an actor; the
sequence's KV moves from the prefill actor's engine to the decode actor's as bytes, and a greedy
stream through the hand-off reads the colocated text token for token, with the hand-offs counted
in ``/metrics``.

The real clock runs this (actors, sockets, subprocesses); nothing asserts speed."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.gateway_process import Gateway, on_ray
from tests.support.kv_handoff import ENGINE, errors, request, streams

pytestmark = pytest.mark.usefixtures("ray_cluster")

MODELS = f"""[[models]]
name = "colocated@1"
workers = 1
dtype = "float32"
{ENGINE}
[[models]]
name = "apart@1"
placement = "ray"
prefill_workers = 1
decode_workers = 1
dtype = "float32"
stats_timeout_ms = 60000
{ENGINE}"""


def test_streams_handed_off_between_ray_actors_read_the_colocated_text(ray_cluster, smollm2, tmp_path):
    gateway = Gateway(tmp_path, on_ray(ray_cluster.address, MODELS))
    try:
        answers = [asyncio.run(streams(gateway, [request("colocated@1", index), request("apart@1", index)]))
                   for index in range(2)]
        workers = gateway.ready()["models"]["apart@1"]["workers"]
        handoffs = gateway.metric("ferry_engine_kv_handoff_bytes_count", model="apart@1")
    finally:
        assert gateway.stop() == 0
    for colocated, apart in answers:
        assert colocated["status"] == apart["status"] == 200
        assert apart["text"] == colocated["text"] and apart["text"]
        assert errors(apart) == []
    assert [w["placement"][:4] for w in workers] == ["ray:", "ray:"]
    assert handoffs >= 2
