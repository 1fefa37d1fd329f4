"""The stop-sequence matcher: whatever the pieces, the client sees the same text and the same stop."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.text.stops import LONG_PIECE, StopMatcher


def stream(stops, pieces) -> tuple[str, str | None]:
    """Feed ``pieces`` in order; the text shown and the stop that ended it."""
    matcher, shown = StopMatcher(stops), []
    for piece in pieces:
        release = matcher.feed(piece)
        shown.append(release.text)
        if release.stop is not None:
            return "".join(shown), release.stop
    return "".join(shown) + matcher.flush(), None


def whole(stops, text) -> tuple[str, str | None]:
    """The reference: the stop that completes first in ``text`` (the longer on a tie)."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (
            best is None or (at + len(stop), -len(stop)) < (best[0] + len(best[1]), -len(best[1]))
        ):
            best = (at, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


def test_a_stop_split_across_pieces_is_held_then_never_shown():
    matcher = StopMatcher(["Human:"])
    assert matcher.feed("Hi. Hum").text == "Hi. " and matcher.held == 3
    release = matcher.feed("an: more")
    assert (release.text, release.stop) == ("", "Human:")
    assert matcher.feed("anything later").text == "" and matcher.flush() == ""


def test_a_held_tail_that_does_not_become_a_stop_is_released_at_once():
    matcher = StopMatcher(["Human:"])
    assert matcher.feed("Hum").text == ""
    assert matcher.feed("ble pie").text == "Humble pie"
    assert matcher.held == 0


def test_only_what_could_begin_a_stop_is_held():
    matcher = StopMatcher(["abc", "xyz"])
    assert matcher.feed("hello a").text == "hello " and matcher.held == 1
    assert matcher.feed("b").text == "" and matcher.held == 2
    assert matcher.feed("x").text == "ab" and matcher.held == 1  # "x" may begin "xyz"
    assert matcher.feed("q").text == "xq" and matcher.held == 0


def test_the_stop_that_completes_first_wins_and_the_longer_on_a_tie():
    assert stream(["abcd", "bc"], list("abcd")) == ("a", "bc")
    assert stream(["abc", "bc"], list("xabc")) == ("x", "abc")
    assert stream(["o w", "ll"], ["hello world"]) == ("he", "ll")


def test_multibyte_characters_are_matched_and_held_whole():
    assert stream(["世界"], ["你好", "世", "界!"]) == ("你好", "世界")
    matcher = StopMatcher(["🙂 bye"])
    shown = "".join(matcher.feed(c).text for c in "hi 🙂 b")
    assert shown == "hi " and matcher.flush() == "🙂 b"


def test_a_long_piece_takes_the_search_path_with_the_same_answer():
    text = "x" * (2 * LONG_PIECE) + "Human"
    matcher = StopMatcher(["Human:"])
    assert matcher.feed(text).text == "x" * (2 * LONG_PIECE) and matcher.held == 5
    assert matcher.feed(":").stop == "Human:"


def test_no_stop_sequences_release_everything():
    assert stream([], ["a", "b"]) == ("ab", None)


def test_an_empty_stop_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


alphabet = st.sampled_from("ab\u00e9\u4e16 ")
stops = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4)


@given(stops, st.text(alphabet, max_size=200), st.lists(st.integers(0, 200), max_size=20))
def test_any_split_into_pieces_gives_the_answer_of_the_whole_text(stop_list, text, cuts):
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    expected = whole(stop_list, text)
    assert stream(stop_list, pieces) == expected
    assert stream(stop_list, list(text)) == expected  # one character at a time
    long = text + "?" * LONG_PIECE  # one piece past LONG_PIECE: the str.find path
    assert stream(stop_list, [long]) == whole(stop_list, long)
