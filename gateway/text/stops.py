"""Stop sequences over a stream of text: release what can no longer be part of a match.

Output arrives in pieces, and a stop sequence may be split across them. The matcher releases
every character that cannot begin a stop sequence and holds back only the tail that still
could, so a client never sees part of a stop sequence nor waits for text already safe to show::

    stops ("Human:",)      fed "Hi. Hum"  -> releases "Hi. "   holds "Hum"
                           fed "an: ok"   -> match: releases "" more, stop "Human:"

The first stop to complete wins (of two at one character, the longer), however the text is
split. Linear in the output: short pieces move an Aho-Corasick automaton over the stops; a long
piece is searched with ``str.find`` and only its tail goes through the automaton."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    """What one piece lets out: ``text`` to show, and the stop sequence that ended it, if any."""

    text: str
    stop: str | None = None


LONG_PIECE = 64
"""A piece longer than this is searched with ``str.find`` rather than walked character by character."""


class _Automaton:
    """Aho-Corasick over the stop sequences: state 0 is the empty string, state ``s`` a prefix
    of some stop sequence, ``depth[s]`` its length and ``done[s]`` the longest stop sequence
    that ends there (its own prefix, or one reached through a failure link), if any."""

    __slots__ = ("children", "depth", "done", "fail")

    def __init__(self, stops: Sequence[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth, self.done = [0], [""]
        for stop in stops:
            state = 0
            for char in stop:
                nxt = self.children[state].get(char)
                if nxt is None:
                    nxt = self.children[state][char] = len(self.children)
                    self.children.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.done.append("")
                state = nxt
            self.done[state] = stop
        self.fail = [0] * len(self.children)
        queue = list(self.children[0].values())
        for state in queue:  # breadth first: a state's failure link is shallower than it
            for char, child in self.children[state].items():
                link = self.step(self.fail[state], char) if state else 0
                self.fail[child] = link
                if len(self.done[link]) > len(self.done[child]):
                    self.done[child] = self.done[link]
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        children, fail = self.children, self.fail
        while True:
            nxt = children[state].get(char)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


@functools.lru_cache(maxsize=1024)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    """The automaton of a set of stop sequences, built once: it never changes after it is built,
    and most requests name none or the same few (its build was a tenth of a request's gateway
    CPU at 1,600 requests/s)."""
    return _Automaton(stops)


_NO_STOPS = _Automaton(())
"""The automaton of a matcher with no stop sequences (most requests): never walked."""


class StopMatcher:
    """Feed it pieces of output in order; :meth:`feed` says what may be shown."""

    __slots__ = ("_automaton", "_held", "_longest", "_state", "stopped", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(stops)) if stops else ()
        if "" in self.stops:
            raise ValueError("stop sequences: expected non-empty strings, got an empty one")
        self.stopped: str | None = None  # the stop sequence that matched: nothing more is released
        self._automaton = _automaton(self.stops) if stops else _NO_STOPS  # most requests name no stop
        self._state = 0
        self._held = ""  # the text of the automaton's state: a tail that may begin a stop
        self._longest = max(map(len, self.stops), default=0)

    def feed(self, piece: str) -> Release:
        """The text of ``piece`` (and of what was held) that can be shown now."""
        if self.stopped is not None:
            return Release("", self.stopped)
        if not self.stops:
            return Release(piece)
        text = self._held + piece
        if len(piece) > LONG_PIECE:
            return self._search(text)
        automaton, state = self._automaton, self._state
        for index, char in enumerate(piece, len(self._held)):
            state = automaton.step(state, char)
            stop = automaton.done[state]
            if stop:
                return self._matched(text[: index + 1 - len(stop)], stop)
        return self._hold(text, state)

    def flush(self) -> str:
        """The output has ended without a match: the held tail is plain text after all."""
        held, self._held, self._state = self._held, "", 0
        return "" if self.stopped is not None else held

    @property
    def held(self) -> int:
        """Characters held back because they may begin a stop sequence."""
        return len(self._held)

    def _search(self, text: str) -> Release:
        """A long piece: the match that completes first (the longer on a tie), else the tail."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
                best = (at + len(stop), -len(stop), stop)
        if best is not None:
            end, negative_length, stop = best
            return self._matched(text[: end + negative_length], stop)
        state, automaton = 0, self._automaton
        for char in text[len(text) - self._longest + 1 :] if self._longest > 1 else "":
            state = automaton.step(state, char)
        return self._hold(text, state)

    def _matched(self, shown: str, stop: str) -> Release:
        self._held, self._state, self.stopped = "", 0, stop
        return Release(shown, stop)

    def _hold(self, text: str, state: int) -> Release:
        keep = self._automaton.depth[state]
        self._state, self._held = state, text[len(text) - keep :]
        return Release(text[: len(text) - keep])
