"""What the gateway hands a backend, what a backend says back, and the protocol both modes keep.

A backend is whatever turns a :class:`Job` into text: the fixed-mode :class:`~batcher.fixed.batcher.Batcher`
(one ``run_batch`` call answers a whole batch) or the continuous mode's engine pool (one engine
step makes one token for many sequences). The gateway, admission, accounting and metrics see
only this module, so a second backend plugs in without a second gateway (docs/architecture.md).

Everything runs on the trio thread and nothing blocks. ``submit`` takes a callback rather than
returning a channel: a task per request would undo the batched hand-offs, while a callback lets
a finished batch of 50 (or a decode step of 200 sequences) queue its events for the bridge in
one pass. A job's events arrive in this order, and end with exactly one of the last two::

    Started ─> Delta ─> Delta ─> ... ─> Finished (stop reason, usage)
                                 └────> Failed (error, retryable, tokens already sent)
    Started ─> Vector ─> Finished      (an embedding model: one vector in place of the text)

A job that is shed at admission gets ``Failed`` at once, from inside ``submit``. A cancelled
job gets no further event. Events are named tuples: immutable like frozen dataclasses, and
cheaper to make, which counts at three events per request (experiments/docs/gateway-http.md,
experiments/docs/constants.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from batcher.core.admission import Load
from batcher.core.config import QueueConfig
from batcher.core.counters import Counters
from workers.protocol import Usage as Usage
from workers.sampling import Sampling as Sampling  # re-exported: the gateway imports them from here


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One request as a backend sees it, checked and priced by the gateway; never changes.

    ``prompt`` is the rendered input (a fixed-mode worker's one string) and ``prompt_tokens``
    its token ids under the model's tokenizer (what a continuous engine prefills, and what
    admission prices). ``sampling`` is how its tokens are picked and its ``max_tokens``, as the
    client asked (a temperature of None: the model's default). ``deadline`` is the seconds it
    may wait for a worker after reaching the core; None means its tier's wait budget.
    ``stream``: the client is shown text as it comes. A continuous backend needs to know: it
    holds a whole answer's text until the answer ends, so that a job whose engine dies can be
    re-run elsewhere without its client noticing, while a stream's tokens go out as they are
    made (and a stream that has sent some cannot be re-run).
    """

    prompt: str
    prompt_tokens: Sequence[int]  # the gateway's tokenizer's list, never changed
    sampling: Sampling
    tier: str | None = None
    tenant: str = ""
    deadline: float | None = None
    stop_sequences: tuple[str, ...] = ()
    stream: bool = False

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


class Started(NamedTuple):
    """A worker has the job; ``queued`` is the seconds it waited for one."""

    queued: float


class Delta(NamedTuple):
    """More output: ``text`` (never a split character) worth ``tokens`` tokens."""

    text: str
    tokens: int


class Vector(NamedTuple):
    """An embedding model's whole output: float32 values packed little-endian."""

    data: bytes


class Finished(NamedTuple):
    """The job ended normally: ``stop_reason`` is ``end_turn`` (the model stopped) or
    ``max_tokens``; the gateway's stop-sequence matcher decides ``stop_sequence`` itself."""

    stop_reason: str
    usage: Usage


class Failed(NamedTuple):
    """The job ended without a whole answer. ``retryable``: sending the same request again may
    well succeed (overload, a worker lost mid-stream), as opposed to an input that fails on its
    own. ``tokens_sent`` counts the tokens of the deltas emitted before it."""

    error: Exception  # a FerryError from a backend; the bridge's own when the core is gone
    retryable: bool
    tokens_sent: int = 0


Event = Started | Delta | Vector | Finished | Failed
OnEvent = Callable[[Event], None]
TERMINAL_EVENTS = (Finished, Failed)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker slot as a snapshot saw it. ``state`` is ``starting`` until its process has
    answered ``ready``; ``details`` are the mode's own figures for it (an engine's running
    sequences and KV blocks), shown by ``/readyz`` as they are and read by nothing else."""

    slot: int
    pid: int | None
    state: str
    restarts: int
    details: Mapping[str, float] = dataclasses.field(default_factory=dict)
    placement: str = "local"  # where its worker runs: "local", or "ray:<address>:<node>"

    @property
    def up(self) -> bool:
        return self.state != "starting"


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
    """What every backend reports the same way, whatever its mode: ``/readyz``, ``ferry
    status`` and ``/metrics`` read these fields and nothing mode-specific.

    ``queued`` is the work waiting in the backend's queues, counted in ``unit`` (a batch
    fills with ``requests``, an engine is loaded with ``tokens``), so a reader never adds one
    to the other. ``reason`` says why a backend that is not ``ready`` should get no traffic
    (empty when it is ready). ``details`` are the mode's own counters, shown by ``/readyz``.
    ``tenants`` are the :data:`TOP_TENANTS` tenants with the most work queued, and that work (in
    ``unit``): ``ferry status`` shows them, ``/readyz`` (often public) does not.
    """

    ready: bool
    reason: str
    workers: tuple[WorkerStatus, ...]
    queued: int
    unit: str
    details: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tenants: Mapping[str, float] = dataclasses.field(default_factory=dict)
    scaling: str = ""  # what the version's scaler last decided, and why (none without a scaler)

    def body(self) -> dict[str, Any]:
        """The status as ``/readyz`` shows it: the common fields, then the mode's own."""
        workers = [{"slot": w.slot, "pid": w.pid, "state": w.state, "restarts": w.restarts,
                    "placement": w.placement, **w.details}
                   for w in self.workers]
        scaling = {"scaling": self.scaling} if self.scaling else {}
        return {"ready": self.ready, "reason": self.reason, "workers": workers, "queued": self.queued,
                "queued_unit": self.unit, **scaling, **self.details}


TOP_TENANTS = 5
"""How many tenants a status names, those with the most work queued."""


def top_tenants(backlogs: Mapping[str, float]) -> dict[str, float]:
    """The :data:`TOP_TENANTS` tenants of ``backlogs`` with the most work queued, most first."""
    ranked = sorted(backlogs.items(), key=lambda pair: (-pair[1], pair[0]))
    return dict(ranked[:TOP_TENANTS])


def not_ready_reason(workers_up: int, proven: bool) -> str:
    """Why a fleet with ``workers_up`` live workers is kept from traffic ("" if it is not):
    none is up, or every slot lost its worker since a call was last answered (``proven``)."""
    if not workers_up:
        return "no worker up"
    return "" if proven else "every worker was lost since one last answered"


C = TypeVar("C", bound=Counters, covariant=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot(Generic[C]):
    """A backend's state, copied on the trio thread so the asyncio side can read it freely:
    ``status`` is what ``/readyz`` and ``ferry status`` show; ``counters`` (the mode's own
    :class:`~batcher.core.counters.Counters`, ``C``) and ``load`` what ``/metrics`` exports,
    through the families of the backend's ``mode`` (:data:`batcher.core.modes.MODES`)."""

    mode: str
    status: Status
    counters: C
    load: Load

    @property
    def ready(self) -> bool:
        return self.status.ready


T = TypeVar("T")


class Backend(Protocol[T]):
    """A backend as the bridge, admission and metrics see it; every method runs on the trio
    thread and returns at once. ``T`` is its tickets' type (``Backend[Any]``: any backend)."""

    def submit(self, job: Job, on_event: OnEvent) -> T:
        """Start a job; its events go to ``on_event`` (see the module doc). Returns the ticket
        that :meth:`cancel` takes. Raises ``ValueError`` for a job the backend cannot take at
        all (an unknown tier), before any event."""

    def cancel(self, ticket: T) -> None:
        """The caller went away: drop the job (from its queue, or its output); no more events."""

    def load(self) -> Load:
        """What overload admission judges new jobs by (:class:`~batcher.core.admission.Load`)."""

    def snapshot(self) -> Snapshot[Counters]:
        """An immutable copy of the backend's state, for health checks and metrics."""

    def retune(self, queue: QueueConfig) -> None:
        """Judge jobs by the tiers' new wait budgets from now on (a live reconfiguration; the
        tiers themselves, their names and order, are the ones the backend was opened with)."""
