"""A fixed-mode request and the batch it rides in.

A :class:`Request` moves through one state machine and reaches exactly one terminal state::

    QUEUED --take--> DISPATCHED --outputs--> DONE
       |                 |  \\--input failed on max_attempts workers--> FAILED (RequestFailed)
       |                 |  \\--no answer by deadline + hang_timeout--> FAILED (WorkersFailed)
       |                 \\--caller went away--> CANCELLED (its output is dropped)
       |--deadline passed before dispatch--> FAILED (Expired, an Overloaded)
       \\--caller went away--> CANCELLED (it leaves the queue at once)

``on_done`` is called exactly once, on the trio thread, when the request reaches a terminal state.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from batcher.core.errors import FerryError


class RequestState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED})


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One input waiting for one output. Times are trio clock readings (seconds)."""

    id: int
    input: str
    tier: int  # index into the tier list: 0 is served first
    arrival: float
    deadline: float  # latest dispatch time (else Overloaded); plus one hang_timeout, latest answer
    on_done: Callable[[Request], None]
    state: RequestState = RequestState.QUEUED
    output: str | bytes | None = None  # a text, or an embedding's packed float32 vector
    error: FerryError | None = None
    dispatched_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def finish(self, output: str | bytes, now: float) -> None:
        """Deliver the output, unless the caller has already gone (then it is dropped)."""
        if self.state is RequestState.DISPATCHED:
            self.output = output
            self._end(RequestState.DONE, now)

    def fail(self, error: FerryError, now: float) -> None:
        if not self.done:
            self.error = error
            self._end(RequestState.FAILED, now)

    def cancel(self, now: float) -> None:
        if not self.done:
            self._end(RequestState.CANCELLED, now)

    def result(self) -> str | bytes:
        """The output, or the request's error raised; only valid once the request is done."""
        if self.state is RequestState.DONE:
            assert self.output is not None, "a done request has its output"
            return self.output
        if self.error is not None:
            raise self.error
        raise RuntimeError(f"request {self.id} is {self.state.value}, it has no result")

    def _end(self, state: RequestState, now: float) -> None:
        self.state = state
        self.finished_at = now
        self.on_done(self)


@dataclasses.dataclass(slots=True, eq=False)
class Batch:
    """Requests that ride to one worker together, and what happened to them so far.

    ``failures`` counts failed calls of this exact batch; ``failed_on`` names the worker slots
    they failed on, so a retry goes elsewhere when it can. A ``suspect`` batch is a half of a
    batch that failed twice: it is split again at its first failure. ``hangs`` counts its calls
    (and its parent's) killed as hung: each doubles the time its next call may take;
    ``worker_faults`` counts its calls (and its parent's) lost to a worker's crash, hang or
    protocol fault, which start its requests' answer deadline.
    ``last_error`` is what its requests are told if they fail: no pid, no slot.
    """

    id: int
    requests: list[Request]
    reason: str  # why it left: "size", "timeout", "retry" or "bisect"
    failures: int = 0
    failed_on: set[int] = dataclasses.field(default_factory=set)
    suspect: bool = False
    last_error: str = ""
    hangs: int = 0
    worker_faults: int = 0  # its calls (and its parent's) that a worker failed, not the model

    @property
    def inputs(self) -> list[str]:
        return [request.input for request in self.requests]

    def prune(self) -> list[Request]:
        """Drop the requests whose callers have gone; return the ones still waiting."""
        self.requests = [r for r in self.requests if r.state is RequestState.DISPATCHED]
        return self.requests
