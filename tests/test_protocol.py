"""The frame codec: round trips, one byte at a time, and every way a frame can be bad."""

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.protocol import (
    Accepted,
    Error,
    FrameDecoder,
    ProtocolError,
    Ready,
    Result,
    RunBatch,
    decode_body,
    encode,
)

EVERY_KIND = [
    Ready(pid=4242, model="sleep-200ms"),
    RunBatch(id=1, inputs=["a", "", "ünïcödé ✓", "x" * 10_000]),
    Accepted(id=1),
    Result(id=1, outputs=["a", "", "✓"]),
    Error(id=9, message="ValueError: boom"),
]


@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: m.kind)
def test_every_message_kind_round_trips(message):
    assert FrameDecoder().feed(encode(message)) == [message]


def test_frames_fed_one_byte_at_a_time_come_out_whole_and_in_order():
    stream = b"".join(encode(message) for message in EVERY_KIND)
    decoder = FrameDecoder()
    received = []
    for position in range(len(stream)):
        received += decoder.feed(stream[position : position + 1])
    assert received == EVERY_KIND
    assert decoder.pending == 0


def test_a_partial_frame_waits_for_the_rest():
    frame = encode(Result(id=3, outputs=["ok"]))
    decoder = FrameDecoder()
    assert decoder.feed(frame[:-1]) == []
    assert decoder.pending == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [Result(id=3, outputs=["ok"])]


def test_an_oversized_frame_is_refused_at_its_header_before_the_body_arrives():
    decoder = FrameDecoder(max_frame=1024)
    with pytest.raises(ProtocolError, match="1025 bytes exceeds 1024"):
        decoder.feed(struct.pack(">I", 1025))


def test_encoding_an_oversized_message_is_refused():
    with pytest.raises(ProtocolError, match="exceeds 100"):
        encode(RunBatch(id=1, inputs=["x" * 200]), max_frame=100)


def _frame(fields) -> bytes:
    body = msgpack.packb(fields)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "not a map"),
        (msgpack.packb({"kind": "launch_missiles"}), "unknown message kind"),
        (msgpack.packb({"id": 1, "outputs": []}), "unknown message kind None"),
        (msgpack.packb({"kind": "result", "id": 1}), "expected \\['id', 'outputs'\\]"),
        (msgpack.packb({"kind": "result", "id": 1, "outputs": [], "x": 1}), "has fields"),
        (msgpack.packb({"kind": "result", "id": "1", "outputs": []}), "result.id"),
        (msgpack.packb({"kind": "result", "id": 1, "outputs": ["a", 2]}), "result.outputs"),
        (msgpack.packb({"kind": "result", "id": True, "outputs": []}), "result.id"),
        (msgpack.packb({"kind": "run_batch", "id": 1, "inputs": "abc"}), "run_batch.inputs"),
    ],
)
def test_a_malformed_frame_says_what_is_wrong(body, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode_body(body)
    with pytest.raises(ProtocolError, match=complaint):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


@given(st.binary(max_size=300))
def test_any_bytes_decode_to_messages_or_a_protocol_error(data):
    try:
        messages = FrameDecoder(max_frame=200).feed(data)
    except ProtocolError:
        return
    assert all(isinstance(m, Ready | RunBatch | Result | Error) for m in messages)


@given(st.lists(st.text(max_size=50), min_size=1, max_size=50), st.integers(0, 2**62))
def test_any_batch_round_trips(inputs, call_id):
    message = RunBatch(id=call_id, inputs=inputs)
    assert FrameDecoder().feed(encode(message)) == [message]
