"""The answer a client sees, built from events: max_tokens, stop sequences, output safety and the
tokens each written piece delivers. Pure: no loop, no server."""

from __future__ import annotations

from batcher.core.backend import Delta, Failed, Finished, Started, Usage
from batcher.core.errors import RequestFailed
from gateway.text.answer import Answer
from gateway.text.safety import Blocklist
from gateway.text.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
END = Finished("end_turn", Usage(1, 0, 1))


def token(text: str) -> Delta:
    """One engine token: its text, worth one token."""
    return Delta(text, 1)


def test_tokens_are_delivered_with_the_text_that_covers_them():
    answer = Answer(("STOP",), 100, BYTES)
    pieces = [
        answer.push([Started(0.0), token("Hi ")]),
        answer.push([token("ST")]),
        answer.push([token("ay"), END]),
    ]
    assert [(p.text, p.tokens) for p in pieces] == [("Hi ", 1), ("", 0), ("STay", 2)]
    assert answer.done and answer.stop_reason == "end_turn" and answer.credited == 3


def test_a_stop_inside_a_token_bills_that_token_s_text_before_it():
    answer = Answer(("\n\nUser:",), 100, BYTES)
    first = answer.push([token("ok"), token(".\n"), token("\nUser: next")])
    assert (first.text, answer.stop_reason, answer.stop_sequence) == ("ok.", "stop_sequence", "\n\nUser:")
    assert answer.credited == 1 + BYTES.count(".")  # "ok", then the shown part of ".\n"


def test_a_fixed_output_longer_than_max_tokens_is_cut_there_and_a_full_one_is_not():
    cut = Answer((), 5, BYTES)
    assert cut.push([Delta("hello world", 11), END]).text == "hello" and cut.stop_reason == "max_tokens"
    exact = Answer((), 2, BYTES)
    assert exact.push([Delta("ab", 2), END]).text == "ab" and exact.stop_reason == "end_turn"


def test_an_engine_that_stops_at_max_tokens_says_so_and_held_text_is_released():
    answer = Answer(("abc",), 3, BYTES)
    piece = answer.push([token("x"), token("a"), token("b"), Finished("max_tokens", Usage(1, 0, 3))])
    assert (piece.text, answer.stop_reason, piece.tokens) == ("xab", "max_tokens", 3)


def test_a_blocked_term_split_across_tokens_is_never_shown_in_a_stream():
    answer = Answer((), 100, BYTES, Blocklist(["secret"]), streaming=True)
    shown = [answer.push([token(t)]).text for t in ("the ", "very ", "sec", "ret", " plan")]
    # the last len("secret") + 1 characters are held until what follows them is known
    assert shown == ["", "th", "e v", "ery", ""] and "sec" not in "".join(shown)
    assert answer.done and answer.stop_reason == "refusal" and answer.blocked == "blocklist[0]"
    assert answer.credited == 1  # only the token "the " was wholly shown


def test_a_word_that_merely_begins_with_a_term_is_shown():
    answer = Answer((), 100, BYTES, Blocklist(["sec"]), streaming=True)
    shown = [answer.push([token(t)]).text for t in ("a ", "sec", "ond", " try")] + [answer.push([END]).text]
    assert "".join(shown) == "a second try" and answer.blocked is None


def test_an_answer_blocked_before_anything_was_shown_is_replaced_by_the_refusal():
    for streaming in (False, True):
        answer = Answer((), 100, BYTES, Blocklist(["sacred"]), streaming=streaming)
        answer.push([Started(0.0), Delta("a sacred text", 13), END])
        completion = answer.completion()
        assert (completion.text, completion.stop_reason) == ("I can't help with that.", "refusal")
        assert completion.output_tokens == BYTES.count("I can't help with that.")


def test_a_failure_keeps_the_tokens_already_covered_and_raises_for_a_whole_answer():
    answer = Answer((), 100, BYTES)
    answer.push([token("one "), Failed(RequestFailed("lost"), retryable=True, tokens_sent=1)])
    assert answer.done and answer.credited == 1 and isinstance(answer.error, RequestFailed)
    try:
        answer.completion()
    except RequestFailed as error:
        assert str(error) == "lost"
    else:
        raise AssertionError("a failed answer has no completion")
