"""Requests, batches and the errors a caller can see: the values every part of the core shares.

A :class:`Request` moves through one state machine and reaches exactly one terminal state::

    QUEUED --take--> DISPATCHED --outputs--> DONE
       |                 |  \\--input failed on max_attempts workers--> FAILED (RequestFailed)
       |                 |  \\--no answer by deadline + hang_timeout--> FAILED (WorkersFailed)
       |                 \\--caller went away--> CANCELLED (its output is dropped)
       |--deadline passed before dispatch--> FAILED (Expired, an Overloaded)
       \\--caller went away--> CANCELLED (it leaves the queue at once)

``on_done`` is called exactly once, on the trio thread, when the request reaches a terminal
state, whichever it is: a caller (the async ``submit``, the HTTP bridge, a simulation) learns
every outcome through that one door.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable


class FerryError(Exception):
    """A request did not get an output; the message says why, for the caller."""


class Overloaded(FerryError):
    """The request was shed at admission, or not dispatched before its deadline (HTTP 529).

    ``retry_after`` is the backend's estimate, in seconds, of when the work now queued ahead
    of such a request will have drained: the ``Retry-After`` a client is told.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Shed(Overloaded):
    """Refused at admission: its estimated wait is over its tier's budget (it never queued)."""


class Expired(Overloaded):
    """Admitted, but not dispatched before its deadline: it left the queue without a GPU call."""


class RequestFailed(FerryError):
    """The request was dispatched but the workers could not answer it (HTTP 500): its own input
    failed on every worker that tried it alone, or (:class:`WorkersFailed`) the fleet failed it."""


class WorkersFailed(RequestFailed):
    """No worker answered a dispatched request by its deadline plus one hang timeout: its calls
    crashed or hung on every worker that took them (a crash loop, a fleet that hangs), and the
    retries ran out of time.

    A 500 like :class:`RequestFailed`, not a 529: the fleet failed, it is not overloaded. There
    is no queue to drain that a ``Retry-After`` could promise, and a 529 would file an outage
    under load shedding, where neither a client's retry policy nor an operator's alert on
    server errors would see it. ``/readyz`` says the same thing to load balancers (503).
    """


class TooLarge(FerryError):
    """The request could never run: its prompt plus ``max_tokens`` needs more KV cache than one
    replica holds (HTTP 400; the message names the limit). Sending it again cannot help."""


class ReplicaLost(RequestFailed):
    """The engine serving a stream died after the stream had sent tokens (HTTP 500,
    ``api_error``: retryable). It is not re-run elsewhere, which would repeat or contradict
    text the client already has; the client retries the request if it wants a whole answer."""


class State(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({State.DONE, State.FAILED, State.CANCELLED})


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One input waiting for one output. Times are trio clock readings (seconds)."""

    id: int
    input: str
    tier: int  # index into the tier list: 0 is served first
    arrival: float
    deadline: float  # latest dispatch time (else Overloaded); plus one hang_timeout, latest answer
    on_done: Callable[[Request], None]
    state: State = State.QUEUED
    output: str | None = None
    error: FerryError | None = None
    dispatched_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def finish(self, output: str, now: float) -> None:
        """Deliver the output, unless the caller has already gone (then it is dropped)."""
        if self.state is State.DISPATCHED:
            self.output = output
            self._end(State.DONE, now)

    def fail(self, error: FerryError, now: float) -> None:
        if not self.done:
            self.error = error
            self._end(State.FAILED, now)

    def cancel(self, now: float) -> None:
        if not self.done:
            self._end(State.CANCELLED, now)

    def result(self) -> str:
        """The output, or the request's error raised; only valid once the request is done."""
        if self.state is State.DONE:
            return self.output  # type: ignore[return-value]
        if self.error is not None:
            raise self.error
        raise RuntimeError(f"request {self.id} is {self.state.value}, it has no result")

    def _end(self, state: State, now: float) -> None:
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
        self.requests = [r for r in self.requests if r.state is State.DISPATCHED]
        return self.requests
