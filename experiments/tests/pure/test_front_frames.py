"""The frames between T6's Rust front and the core (experiments/front_batched.py): what the core
reads is what the front writes, byte for byte, and what it writes is what the front reads."""

import struct

import msgspec

from experiments.front_batched import decode_frame, encode_answers, split_frames

# [[[5, 1, b'{}']], [3]] as the Rust front writes it (rmp: the smallest int form, bin 8 bodies)
FRONT_FRAME = bytes([0x92, 0x91, 0x93, 0x05, 0x01, 0xC4, 0x02]) + b"{}" + bytes([0x91, 0x03])


def framed(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def test_a_front_frame_reads_as_its_requests_and_its_cancelled_ids():
    assert decode_frame(FRONT_FRAME) == ([(5, 1, b"{}")], [3])


def test_frames_are_taken_whole_and_a_partial_one_waits_for_its_rest():
    second = framed(FRONT_FRAME)
    buffer = bytearray(framed(FRONT_FRAME) + second[:7])
    assert split_frames(buffer) == [FRONT_FRAME]
    assert bytes(buffer) == second[:7]  # kept until the rest arrives
    buffer += second[7:]
    assert split_frames(buffer) == [FRONT_FRAME]
    assert buffer == bytearray()


def test_an_answer_frame_is_its_length_then_id_status_and_the_body_as_binary():
    answers = [(2**40, 200, b'{"type":"message"}'), (7, 529, b'{"type":"error"}')]
    frame = encode_answers(answers)
    (length,) = struct.unpack_from("<I", frame)
    assert length == len(frame) - 4
    # the front reads each body as msgpack bin (not str), each id and status as an int of any width
    assert msgspec.msgpack.decode(frame[4:]) == [list(answer) for answer in answers]
