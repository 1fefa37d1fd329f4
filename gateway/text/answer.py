"""One request's answer as its client sees it, built from its backend's events: pure. Streamed
and whole answers read the same events through the same :class:`Answer`, so they can never
disagree. Each :class:`~batcher.core.backend.Delta` goes through three stages::

    Delta ─> max_tokens (cut the text at the limit) ─> stop sequences (hold a possible start)
          ─> safety (hold the last words until they can be judged) ─> released text

:meth:`Answer.push` returns the text to write and the tokens writing it delivers, which the
handler credits only after the write (a stop sequence is never shown, so never billed). When
safety blocks, an answer that has shown nothing yet is replaced by the refusal, and a stream that
has shown text ends there: either way ``stop_reason`` is ``refusal``. The prompt tokens the
prefix cache supplied (``cached``) come with the end; a failure says whether a retry may help."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from batcher.core.backend import Delta, Event, Failed, Finished
from batcher.core.tokenizer import Tokenizer
from gateway.text.safety import SafetyCheck
from gateway.text.stops import StopMatcher
from gateway.wire.api import Completion


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Text the client may be shown now, and the tokens that showing it delivers."""

    text: str
    tokens: int


class Answer:
    """Feed it a job's events in order (:meth:`push`); read the outcome once :attr:`done`."""

    __slots__ = (
        "_consumed",
        "_covered_end",
        "_covered_tokens",
        "_generated",
        "_lookback",
        "_marks",
        "_matcher",
        "_max_tokens",
        "_refused",
        "_released",
        "_safety",
        "_screened",
        "_streaming",
        "_tokenizer",
        "_unscreened",
        "blocked",
        "cached",
        "credited",
        "done",
        "error",
        "parts",
        "retryable",
        "stop_reason",
        "stop_sequence",
    )

    def __init__(
        self, stops: tuple[str, ...], max_tokens: int, tokenizer: Tokenizer,
        safety: SafetyCheck | None = None, streaming: bool = False,
    ) -> None:
        self._matcher = StopMatcher(stops)
        self._max_tokens = max_tokens
        self._tokenizer = tokenizer
        self._safety = safety
        self._lookback = safety.lookback if safety is not None else 0
        self._streaming = streaming
        self._screened = ""  # released text the next screening still needs as context
        self._unscreened = ""  # text past the stop matcher, not yet screened
        self._marks: collections.deque[tuple[int, int]] = collections.deque()  # (stream end, tokens)
        self._consumed = 0  # characters that entered the stop matcher
        self._released = 0  # characters released so far (model text, not a refusal)
        self._covered_end = 0  # characters of the deltas the released text covers entirely
        self._covered_tokens = 0  # and their tokens
        self._refused: int | None = None  # tokens of the refusal that replaced the answer
        self._generated = 0  # tokens of every delta taken in
        self.credited = 0  # tokens handed out with released pieces
        self.parts: list[str] = []  # every released piece, in order
        self.done = False
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.error: BaseException | None = None
        self.retryable = False  # of a failure: sending the same request again may well succeed
        self.cached = 0  # prompt tokens the prefix cache supplied (known at the end)
        self.blocked: str | None = None  # the safety rule that ended the answer, if any

    def push(self, events: Iterable[Event]) -> Piece:
        """Take in events; the text that may be shown now and the tokens showing it delivers."""
        texts: list[str] = []
        for event in events:
            if self.done:
                break
            if isinstance(event, Delta):
                texts.append(self._delta(event))
            elif isinstance(event, Finished):
                self.cached = event.usage.cached_tokens
                texts.append(self._end(event.stop_reason))
            elif isinstance(event, Failed):
                self.done, self.error, self.retryable = True, event.error, event.retryable
        text = "".join(texts)
        if text:
            self.parts.append(text)
        if self._refused is not None:
            tokens = self._refused
        elif self.done and self.error is None and self.stop_reason != "refusal":
            tokens = self._covered() + self._tokenizer.count(self._uncovered())
        else:
            tokens = self._covered()
        piece = Piece(text, tokens - self.credited)
        self.credited = tokens
        return piece

    def completion(self) -> Completion:
        """The whole answer (raises the job's error if it failed)."""
        if self.error is not None:
            raise self.error
        if not self.done:
            raise RuntimeError("the answer is not finished")
        reason = self.stop_reason or "end_turn"
        return Completion("".join(self.parts), reason, self.stop_sequence, self.credited, self.cached)

    def _delta(self, delta: Delta) -> str:
        text, tokens, limit = delta.text, delta.tokens, self._max_tokens - self._generated
        cut = tokens > limit
        if cut:  # a fixed-mode output longer than max_tokens: cut it there
            text = self._tokenizer.truncate(text, limit)
            tokens = self._tokenizer.count(text)
        self._generated += tokens
        self._consumed += len(text)
        self._marks.append((self._consumed, self._generated))
        release = self._matcher.feed(text)
        if release.stop is not None:
            self.stop_sequence = release.stop
            return self._screen(release.text, "stop_sequence")
        if cut:
            return self._screen(release.text + self._matcher.flush(), "max_tokens")
        return self._screen(release.text, None)

    def _end(self, stop_reason: str) -> str:
        return self._screen(self._matcher.flush(), stop_reason)

    def _screen(self, text: str, stop_reason: str | None) -> str:
        """Safety's judgement of the text about to be shown; ``stop_reason`` set: the last of it."""
        final = stop_reason is not None
        if final:
            self.done, self.stop_reason = True, stop_reason
        if self._safety is None or not self._lookback:
            self._released += len(text)
            return text
        pending = self._unscreened + text
        rule = self._safety.screen_stream(self._screened + pending, final)
        if rule is not None:
            return self._refuse(rule)
        keep = 0 if final else min(len(pending), self._lookback)
        shown, self._unscreened = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._screened = (self._screened + shown)[-self._lookback :]
        self._released += len(shown)
        return shown

    def _refuse(self, rule: str) -> str:
        self.done, self.blocked, self._unscreened = True, rule, ""
        self.stop_reason, self.stop_sequence = "refusal", None
        if self._streaming and self._released:
            return ""
        assert self._safety is not None, "only the safety stage refuses"
        refusal = self._tokenizer.truncate(self._safety.refusal, self._max_tokens)
        self.parts.clear()
        self._refused = self._tokenizer.count(refusal)  # what the client receives instead
        return refusal

    def _covered(self) -> int:
        """Tokens of the deltas whose text the released text covers entirely."""
        marks = self._marks
        while marks and marks[0][0] <= self._released:
            self._covered_end, self._covered_tokens = marks.popleft()
        return self._covered_tokens

    def _uncovered(self) -> str:
        """Released text of a delta cut short by a stop sequence: its tokens are delivered too."""
        if self._released == self._covered_end:
            return ""
        return "".join(self.parts)[self._covered_end : self._released]
