"""One job's token ids into the events its caller reads: pure, no clock, no I/O.

The pool feeds an :class:`Output` each ``tokens`` frame of the job's sequence, then its end;
ids become text through the model's incremental detokenizer, which never splits a character::

    stream   Started, then a Delta as soon as new ids make text, ..., Finished
    whole    nothing until the end, then Started, one Delta with all the text, Finished

Holding a whole answer back is what lets the pool re-run it unseen when its engine dies
(:meth:`Output.restart`); a stream that has sent text ends with ``Failed``, or, where its model
resumes streams, goes on from ``ids`` on another engine, through the same detokenizer. The engine
never sends an end-of-sequence id; :meth:`Output.finish` bills its count with the last delta.
"""

from __future__ import annotations

from collections.abc import Sequence

from batcher.core.backend import Delta, Failed, Finished, Job, OnEvent, Started, Usage
from batcher.core.tokenizer import Detokenizes


class Output:
    """The events of one job, from its ids (see the module doc)."""

    __slots__ = (
        "_decoder",
        "_longest",
        "_parts",
        "_pending",
        "_tokenizer",
        "_watch",
        "ids",
        "job",
        "on_event",
        "sent",
        "started",
    )

    def __init__(self, job: Job, on_event: OnEvent, tokenizer: Detokenizes) -> None:
        self.job, self.on_event, self._tokenizer = job, on_event, tokenizer
        self._longest = max(map(len, job.stop_sequences), default=0)
        self.sent = 0  # tokens in the deltas emitted so far: once > 0, a stream cannot be re-run
        self.started = False
        self.restart()

    def restart(self) -> None:
        """Forget what the lost sequence made: it runs again from its prompt, unseen."""
        assert not self.sent, "a stream that has sent text cannot be run again"
        self._decoder = self._tokenizer.detokenizer()
        self._parts: list[str] = []
        self._pending = 0  # tokens whose text has not been emitted
        self._watch = ""  # the end of a whole answer's text, where a stop sequence may begin
        self.ids: list[int] = []  # every id taken (max_tokens at most): where a resumed sequence goes on

    @property
    def generated(self) -> int:
        """Tokens taken so far, on every engine it ran on."""
        return len(self.ids)

    def push(self, ids: Sequence[int], queued: float) -> bool:
        """Take a frame's ``ids``. True when a whole answer's text now holds one of its stop
        sequences: the answer can end here."""
        self.ids += ids
        text = self._decoder.push(list(ids))
        self._pending += len(ids)
        if self.job.stream:
            if text:
                self._emit(text, queued)
            return False
        self._parts.append(text)
        return self._stop_seen(text)

    def finish(self, stop_reason: str, usage: Usage, queued: float) -> None:
        """The sequence ended normally (``end_turn`` or ``max_tokens``): the rest of the text, then
        ``Finished``. The stop token the engine counted but did not send is delivered with that
        last delta (one with no text if nothing is left): it is the model's answer that it is done,
        and it is billed, as vLLM and OpenAI count it."""
        text = "".join(self._parts) + self._decoder.flush()
        self._pending += max(0, usage.output_tokens - self.generated)
        if text or self._pending or not self.started:
            self._emit(text, queued)
        self.on_event(Finished(stop_reason, usage))

    def fail(self, error: Exception, retryable: bool) -> None:
        self.on_event(Failed(error, retryable, self.sent))

    def _emit(self, text: str, queued: float) -> None:
        if not self.started:
            self.started = True
            self.on_event(Started(queued))
        if text or self._pending:
            self.on_event(Delta(text, self._pending))
            self.sent += self._pending
            self._pending = 0
        self._parts = []

    def _stop_seen(self, text: str) -> bool:
        """Whether a stop sequence ends in the text so far; looks only at ``text`` and the
        ``longest - 1`` characters before it, so the cost is bounded by the new text."""
        if not self._longest:
            return False
        window = self._watch + text
        self._watch = window[-(self._longest - 1) :] if self._longest > 1 else ""
        return any(stop in window for stop in self.job.stop_sequences)
