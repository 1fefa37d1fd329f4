"""The frame codec: round trips, one byte at a time, and every way a frame can be bad."""

import struct
import typing

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.engine.sequence import FinishReason
from workers.protocol import (
    NO_ENGINE_STATS,
    Abort,
    Accepted,
    Add,
    EngineStats,
    Error,
    FinishReasonName,
    FrameDecoder,
    Message,
    ProtocolError,
    Ready,
    Result,
    RunBatch,
    SequenceFinished,
    StepBegun,
    Tokens,
    Usage,
    decode_body,
    encode,
)

ADD = Add(
    rid=7, prompt_tokens=[1, 2, 3] * 1000, max_tokens=64, tier=1, tenant="acme", temperature=0.7, top_p=0.9,
    top_k=40, seed=None, stop_token_ids=[2, 50256], ignore_eos=False,
)
STATS = EngineStats(
    step=12, running=3, waiting=1, free_blocks=40, used_blocks=24, total_blocks=64,
    cached_blocks=5, preemptions=2, prefix_queries=1500, prefix_hits=320, computed_tokens=2100,
    generated_tokens=36,
)
EVERY_KIND = [
    Ready(pid=4242, model="sleep-200ms"),
    RunBatch(id=1, inputs=["a", "", "ünïcödé ✓", "x" * 10_000]),
    Accepted(id=1),
    Result(id=1, outputs=["a", "", "✓"]),
    Error(id=9, message="ValueError: boom"),
    ADD,
    msgspec.structs.replace(
        ADD, rid=8, seed=2**63, ignore_eos=True, tenant="", stop_token_ids=[], temperature=0
    ),
    Abort(rid=7),
    Tokens(rid=7, ids=[4242]),
    SequenceFinished(rid=7, reason="stop_token", usage=Usage(prompt_tokens=3000, cached_tokens=2992,
                                                             output_tokens=12)),
    SequenceFinished(rid=8, reason="too_long", usage=Usage(prompt_tokens=90_000, cached_tokens=0,
                                                           output_tokens=0)),
    STATS,
    StepBegun(seconds=2.5),
    StepBegun(seconds=float("inf")),  # it has measured no step: the pool's bound holds it
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


def _fields(message) -> dict:
    return msgspec.to_builtins(message)


_USAGE = {"prompt_tokens": 1, "cached_tokens": 0, "output_tokens": 1}
_FINISHED = {"kind": "finished", "rid": 1, "reason": "eos", "usage": _USAGE}
_pack = msgspec.msgpack.encode
_RESULT_HEAD = b"\x83" + _pack({"kind": "result", "id": 1})[1:]  # a map of 3 fields, 2 of them written


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"\xc1", "not msgpack"),
        (_pack({"kind": "result", "id": 1, "outputs": []}) + b"\x00", "not msgpack.*trailing"),
        (_pack([1, 2, 3]), "Expected `object`, got `array` - at `frame`"),
        (_pack({"kind": "launch_missiles"}), "Invalid value 'launch_missiles' - at `frame.kind`"),
        (_pack({"kind": 7}), "at `frame.kind`"),
        (_pack({"id": 1, "outputs": []}), "missing required field `kind`"),
        (_pack({"kind": "result", "id": 1}), "missing required field `outputs` - at `result`"),
        (_pack({"kind": "result", "id": 1, "outputs": [], "x": 1}), "unknown field `x` - at `result`"),
        (_pack({"kind": "result", "id": "1", "outputs": []}), "got `str` - at `result.id`"),
        (_pack({"kind": "result", "id": 1, "outputs": ["a", 2]}), "result.outputs\\[1\\]"),
        (_pack({"kind": "result", "id": True, "outputs": []}), "got `bool` - at `result.id`"),
        (_pack({"kind": "run_batch", "id": 1, "inputs": "abc"}), "run_batch.inputs"),
        (_pack({**_fields(ADD), "seed": "42"}), "add.seed"),
        (_pack({**_fields(ADD), "ignore_eos": 1}), "add.ignore_eos"),
        (_pack({**_fields(ADD), "top_p": "0.9"}), "add.top_p"),
        (_pack({**_fields(ADD), "prompt_tokens": [1, True]}), "add.prompt_tokens"),
        (_pack({k: v for k, v in _fields(ADD).items() if k != "tenant"}), "field `tenant` - at `add`"),
        (_pack({"kind": "abort", "rid": None}), "abort.rid"),
        (_pack({"kind": "tokens", "rid": 1, "ids": 5}), "tokens.ids"),
        (_pack({**_FINISHED, "reason": "exploded"}), "'exploded' - at `finished.reason`"),
        (_pack({**_FINISHED, "usage": [1, 2, 3]}), "finished.usage"),
        (_pack({**_FINISHED, "usage": {**_USAGE, "x": 1}}), "unknown field `x` - at `finished.usage`"),
        (_pack({**_FINISHED, "usage": {"prompt_tokens": 1}}), "finished.usage"),
        (_pack({**_fields(STATS), "running": -0.5}), "stats.running"),
        (_pack({"kind": "step", "seconds": float("nan")}), "Expected `float` >= 0.0 - at `step.seconds`"),
        (_pack({"kind": "step", "seconds": -1.0}), "Expected `float` >= 0.0 - at `step.seconds`"),
        (_pack({"kind": "step", "seconds": "1"}), "at `step.seconds`"),
        # a million arrays deep: the field, an unknown one, and a map nested too deep to read
        (_RESULT_HEAD + b"\xa7outputs" + b"\x91" * 10**6 + b"\x01", "outputs\\[0\\]"),
        (_RESULT_HEAD + b"\xa1x" + b"\x91" * 10**6 + b"\x01", "unknown field `x`"),
        (b"\x81\xa1x" * 10**6 + b"\x01", "not msgpack: maximum recursion depth"),
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
    assert all(isinstance(m, typing.get_args(Message)) for m in messages)


@given(st.lists(st.text(max_size=50), min_size=1, max_size=50), st.integers(0, 2**62))
def test_any_batch_round_trips(inputs, call_id):
    message = RunBatch(id=call_id, inputs=inputs)
    assert FrameDecoder().feed(encode(message)) == [message]


def test_the_finish_reasons_on_the_wire_are_the_engines():
    assert typing.get_args(FinishReasonName) == tuple(reason.value for reason in FinishReason)


def test_a_frame_on_the_wire_is_a_length_and_a_map_that_names_its_kind_first():
    """The bytes other engines (another interpreter, another language) read and write."""
    assert encode(Error(id=7, message="boom")) == (
        b"\x00\x00\x00\x1d" b"\x83" b"\xa4kind\xa5error" b"\xa2id\x07" b"\xa7message\xa4boom"
    )
    for message in EVERY_KIND:
        fields = msgspec.msgpack.decode(encode(message)[4:])
        assert list(fields) == ["kind", *message.__struct_fields__]
        assert fields == {"kind": message.kind, **msgspec.to_builtins(message)}


@given(
    st.lists(st.integers(0, 2**31), max_size=100), st.integers(0, 2**31), st.text(max_size=20),
    st.floats(0, 2, allow_nan=False), st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.booleans(),
)
def test_any_add_round_trips(prompt, max_tokens, tenant, temperature, seed, ignore_eos):
    message = Add(1, prompt, max_tokens, 0, tenant, temperature, 1.0, 0, seed, [2], ignore_eos)
    assert FrameDecoder().feed(encode(message)) == [message]


def test_a_replica_counts_across_its_engines_by_adding_counters_not_gauges():
    lost = msgspec.structs.replace(STATS, running=9, free_blocks=1)
    carried = NO_ENGINE_STATS.plus_counters(lost)
    assert (carried.running, carried.free_blocks) == (0, 0)
    assert (carried.preemptions, carried.generated_tokens) == (2, 36)
    now = STATS.plus_counters(carried)
    assert (now.running, now.free_blocks) == (3, 40)
    assert (now.step, now.prefix_hits, now.generated_tokens) == (24, 640, 72)
