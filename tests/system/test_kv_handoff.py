"""Prefill and decode on separate engines over real HTTP: ``ferry serve`` with SmolLM2-135M in
float32 (one thread an engine) as one colocated replica (``colocated@1``) and as one prefill and
one decode replica (``apart@1``, ``on_engine_loss = "resume"``), every request's KV moved between
the two engine processes as bytes.

Streams through the hand-off read the colocated model's text token for token, the later ones
finding the chat template's prefix in the decode engine's cache, and ``/metrics`` breaks each
hand-off's pause into parts that add up to it; then the prefill engine, and
then the decode engine, is SIGKILLed while eight streams run (some still prefilling, some handed
off): each stream completes with that same text, no error event, no token twice; the prefill
engine's streams had shown nothing (the first token and the KV leave it in one write) and run
again unseen, the decode engine's had shown text and resume. Greedy
throughout: the Messages route takes no seed.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from batcher.continuous.handoff_phases import PHASES
from tests.support.gateway_process import Gateway, tiers_and_keys
from tests.support.kv_handoff import ENGINE, errors, request, streams
from workers.kv_manifest import SHM_DIR

CONFIG = f"""
[server]
port = 0

{tiers_and_keys(120000)}

[[models]]
name = "colocated@1"
workers = 1
{ENGINE}
[[models]]
name = "apart@1"
prefill_workers = 1
decode_workers = 1
on_engine_loss = "resume"
{ENGINE}"""

CONTEXT = " ".join(f"Note {i}: the harbour opens at {6 + i % 4}, its boats are blue." for i in range(20))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, smollm2):
    gateway = Gateway(tmp_path_factory.mktemp("handoff"), CONFIG)
    yield gateway
    assert gateway.stop() == 0


def test_streams_through_a_handoff_read_the_colocated_text(gateway):
    for index in range(4):  # one after another: each finds the one before's prefix on the decode engine
        colocated, apart = asyncio.run(streams(gateway, [request("colocated@1", index),
                                                         request("apart@1", index)]))
        assert colocated["status"] == apart["status"] == 200
        assert apart["text"] == colocated["text"] and apart["text"]
        assert errors(apart) == []
    assert gateway.metric("ferry_engine_kv_handoff_bytes_count", model="apart@1") >= 4
    assert gateway.metric("ferry_engine_kv_handoff_bytes_sum", model="apart@1") > 4 * 30 * 46080
    handed = gateway.metric("ferry_engine_kv_handoff_seconds_count", model="apart@1")
    assert handed >= 4
    parts = {phase: gateway.metric("ferry_engine_kv_handoff_phase_seconds_sum", model="apart@1", phase=phase)
             for phase in PHASES}
    assert {gateway.metric("ferry_engine_kv_handoff_phase_seconds_count", model="apart@1", phase=phase)
            for phase in PHASES} == {handed}  # every hand-off's parts, each counted once
    pause = gateway.metric("ferry_engine_kv_handoff_seconds_sum", model="apart@1")
    assert sum(parts[phase] for phase in ("send", "wait", "import", "step", "after")) == pytest.approx(pause)
    assert parts["export"] > 0 and parts["import"] > 0 and parts["step"] > 0
    hits = gateway.metric("ferry_engine_prefix_cache_hits_total", model="apart@1", replica="1")
    assert hits >= 3 * 16  # the decode engine kept what it received, and the later ones found it


@pytest.mark.parametrize(
    ("slot", "outcome"),
    [
        (0, "ferry_engine_reruns_total"),  # what it held had shown nothing: run again, unseen
        (1, "ferry_engine_resumed_streams_total"),  # what it held had shown text: resumed
    ],
    ids=["prefill", "decode"],
)
def test_an_engine_killed_mid_handoff_loses_no_stream_and_repeats_no_token(gateway, slot, outcome):
    expected = asyncio.run(streams(gateway, [request("colocated@1", i, CONTEXT) for i in range(8)]))
    before = gateway.metric(outcome, model="apart@1")
    killed = asyncio.run(streams(gateway, [request("apart@1", i, CONTEXT) for i in range(8)], kill=slot))
    assert [errors(result) for result in killed] == [[]] * 8
    assert [result["text"] for result in killed] == [result["text"] for result in expected]
    assert gateway.metric(outcome, model="apart@1") > before
    assert gateway.metric("ferry_engine_interrupted_streams_total", model="apart@1") == 0
    # the KV went through /dev/shm (local engines), and the killed engine left no segment there
    prefill = gateway.ready()["models"]["apart@1"]["workers"][0]
    assert "--kv-shm" in pathlib.Path(f"/proc/{prefill['pid']}/cmdline").read_text().split("\0")
    assert sorted(SHM_DIR.glob("ferry-kv-*")) == []
