"""The errors a caller can see, whatever the mode: one class per outcome the HTTP side maps to
one status (529 for ``Overloaded``, 413 for ``TooLarge``, 500 for ``RequestFailed``)."""

from __future__ import annotations


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


class Starting(Overloaded):
    """No worker serves the model now and none can be ready within the request's wait budget:
    a version scaled to zero, starting (HTTP 503, ``overloaded_error``). ``retry_after`` is the
    expected time until one is ready, so that a client's SDK retries when it can be served."""


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
