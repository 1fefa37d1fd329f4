"""A job's ids into events, pure: a stream's deltas as text completes, a whole answer held to its
end, a held answer run again unseen, a whole answer's stop spotted. (Stop tokens never reach it:
the engine does not send them, ``tests/system/test_engine_worker.py``; the count it reports at the end
bills them.)"""

from __future__ import annotations

import pytest

from batcher.continuous.token_stream import Output
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling, Started, Usage
from batcher.core.errors import ReplicaLost
from gateway.text.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def output(stream: bool, stops: tuple[str, ...] = ()) -> tuple[Output, list]:
    events: list = []
    job = Job("p", (1, 2, 3), Sampling(50), stop_sequences=stops, stream=stream)
    return Output(job, events.append, BYTES), events


def test_a_stream_sends_a_delta_whenever_its_ids_complete_text_and_counts_the_ids_it_carried():
    out, events = output(stream=True)
    for ids in ([104], [195], [169], [33]):  # h, then é in two bytes, then !
        out.push(ids, queued=0.25)
    out.finish("end_turn", Usage(3, 0, 4), queued=0.25)
    assert events == [
        Started(0.25),
        Delta("h", 1),
        Delta("é", 2),
        Delta("!", 1),
        Finished("end_turn", Usage(3, 0, 4)),
    ]
    assert out.sent == 4


def test_a_whole_answer_is_one_delta_at_its_end_billed_as_the_engine_counted():
    out, events = output(stream=False)
    out.push([104], queued=0.1)
    out.push([105], queued=0.1)
    assert events == []
    out.finish("end_turn", Usage(3, 0, 3), queued=0.1)  # the engine counts the end id it did not send
    assert events == [Started(0.1), Delta("hi", 3), Finished("end_turn", Usage(3, 0, 3))]  # the end id billed
    assert (out.generated, out.sent) == (2, 3)


def test_a_stream_that_ends_before_any_text_still_starts_and_finishes_billing_its_end_id():
    out, events = output(stream=True)
    out.finish("end_turn", Usage(3, 0, 1), queued=0.0)  # its first id was the end of sequence
    assert events == [Started(0.0), Delta("", 1), Finished("end_turn", Usage(3, 0, 1))]


def test_a_held_answer_runs_again_from_nothing_and_its_client_sees_only_the_second_run():
    out, events = output(stream=False)
    out.push([120, 121, 122], queued=0.0)
    out.restart()  # its engine died
    out.push([97], queued=0.5)
    out.finish("max_tokens", Usage(3, 0, 1), queued=0.5)
    assert events == [Started(0.5), Delta("a", 1), Finished("max_tokens", Usage(3, 0, 1))]


def test_a_stream_that_sent_text_fails_with_its_count_and_can_never_run_again():
    out, events = output(stream=True)
    out.push([111, 107], queued=0.0)
    error = ReplicaLost("lost")
    out.fail(error, retryable=True)
    assert events[-1] == Failed(error, True, 2)
    with pytest.raises(AssertionError):
        out.restart()


def test_a_whole_answer_spots_its_stop_sequence_even_split_across_frames():
    out, _ = output(stream=False, stops=("END", "zz"))
    assert [out.push([ord(c)], 0.0) for c in "abcEN"] == [False] * 5
    assert out.push([ord("D")], 0.0) is True
    streaming, _ = output(stream=True, stops=("END",))  # a stream leaves stops to the gateway
    assert [streaming.push([ord(c)], 0.0) for c in "END"] == [False] * 3
