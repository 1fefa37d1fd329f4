"""WorkerPool: the fixed mode's workers, one call each at a time, kept alive and honest.

Each slot's :class:`~batcher.core.supervisor.Supervisor` keeps its worker process up; the pool
serves it batches one by one. A call that crashes the worker, breaks the protocol or hangs costs
the worker its life; an error reply or a wrong output count fails the call alone. Either way the
batch goes to the retry backlog (:mod:`batcher.fixed.retries`: retried, bisected, or failed by
its deadline plus one ``hang_timeout``), which idle workers drain first; a slow fleet stretches
the hang limit, within a cap (:mod:`batcher.fixed.call_time`; docs/fixed-mode.md, "What happens
when a worker fails"). Which slots a scaler has staffed is kept in
:class:`~batcher.core.staffing.Staffing`; the pool acts on it. When each worker takes its next
batch (dispatch ahead) is forecast by :mod:`batcher.fixed.opening`."""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence

import trio

from batcher.core.config import TEXT, Outputs, PoolConfig
from batcher.core.errors import Starting, WorkersFailed
from batcher.core.scaler import Fleet, leaving
from batcher.core.staffing import Staffing
from batcher.core.supervisor import Readiness, SlotStartError, Supervisor, start_slots
from batcher.fixed.call_time import CallTime
from batcher.fixed.counters import BatchCounters
from batcher.fixed.opening import Openings
from batcher.fixed.replies import reply_fault
from batcher.fixed.request import Batch, Request, RequestState
from batcher.fixed.retries import RetryBacklog
from batcher.fixed.slot import SERVING, Slot, SlotState, Spawn, Worker, WorkerInfo
from workers.protocol import NotDelivered, ProtocolError, Result, RunBatch, Skip, WorkerLost

log = logging.getLogger("ferry.pool")

class WorkerPool:
    def __init__(self, config: PoolConfig, spawn: Spawn, counters: BatchCounters | None = None,
                 outputs: Outputs = TEXT) -> None:
        self.config = config
        self.outputs = outputs
        """What every answer must be (a reply of another kind fails its call)."""
        self.counters = counters if counters is not None else BatchCounters()
        self.on_idle: Callable[[], None] = lambda: None
        """Called when a worker frees up with no retry to take, or starts the batch that waited
        in its pipe (it may then be sent the next one ahead): the batcher's wake-up."""
        self.on_answer: Callable[[int, float], None] = lambda size, seconds: None
        """Called with (batch size, seconds) for every call answered in full: policy feedback."""
        self.call_time = CallTime(config.hang_timeout)
        """The recent call time, and the hang limits it paces."""
        self._slots = [Slot(index) for index in range(config.workers)]
        for slot in self._slots:
            slot.supervisor = Supervisor(
                slot.index, spawn, config, self.counters, functools.partial(self._serve, slot),
                on_exit=functools.partial(self._exited, slot), on_down=functools.partial(self._down, slot),
                idle=functools.partial(self._is_idle, slot),
                on_retired=functools.partial(self._stopped, slot),
            )
        initial = config.workers if config.initial is None else config.initial
        for slot in self._slots[initial:]:
            slot.state = SlotState.STOPPED
        self.staffing = Staffing(config.workers, initial)
        """Which slots a scaler has staffed, warm or leaving, and the measured start time."""
        self._nursery: trio.Nursery | None = None
        self._idle: list[Slot] = []  # by slot index: the lowest idle GPU takes the next batch
        self._batch_ids = itertools.count(1)
        self._retry = RetryBacklog(config, self.counters, self._batch_ids)
        self._readiness = Readiness(initial)
        self._probe: Request | None = None  # the probe call in flight, if any

    @property
    def call_seconds(self) -> float:
        """Recent duration of an answered call (an EWMA; 0 until the first answer)."""
        return self.call_time.seconds

    @property
    def busy_count(self) -> int:
        return sum(slot.state is SlotState.BUSY for slot in self._slots)

    @property
    def live_workers(self) -> int:
        """Workers up and able to take a call (idle or busy), not starting, warm or leaving."""
        return sum(map(self._taking, self._slots))

    def _taking(self, slot: Slot) -> bool:
        return slot.state in SERVING and slot.index not in self.staffing.leaving

    @property
    def ready(self) -> bool:
        """Whether this fleet should be sent traffic (``/readyz``): a worker is up and not hung,
        and a call has been answered since every slot last lost its worker, if that ever happened.

        A worker is hung once its call has run past the hang timeout (or the slow fleet's longer
        allowance, :meth:`~batcher.fixed.call_time.CallTime.paced`), even while supervision still
        lets a batch that hung before run longer: with every worker up hung, nothing the fleet is
        sent can start."""
        now = trio.current_time()
        if not self.staffing.staffed:  # scaled to zero: a request starts a worker, so it takes traffic
            return True
        return self._readiness.proven and any(self._state(slot, now) in SERVING for slot in self._slots)

    def cold(self, now: float, budget: float) -> Starting | None:
        """A request with ``budget`` seconds to wait, arriving at a fleet with no worker up
        (scaled to zero, its worker starting): None to let it wait, else the 503 that says when
        one will be ready (:meth:`~batcher.core.staffing.Staffing.cold`)."""
        if any(slot.state in (*SERVING, SlotState.WARM) for slot in self._slots):
            return None
        return self.staffing.cold(now, budget)

    def openings(self) -> Openings:
        """When each live worker takes its next batch, forecast from the workers as they are now
        (:mod:`batcher.fixed.opening`): what the batcher flushes by and admission plans with."""
        live = {slot.index: slot if slot.state is SlotState.BUSY else None
                for slot in self._slots if self._taking(slot)}
        ahead = self.config.dispatch_ahead
        return Openings(len(self._idle), live, self.call_seconds, ahead, retrying=bool(self._retry))

    def workers(self) -> list[WorkerInfo]:
        """Every staffed slot (a stopped one, which a scaler may staff later, is left out)."""
        now = trio.current_time()
        return [WorkerInfo(slot.index, worker.pid if (worker := slot.supervisor.worker) else None,
                           self._state(slot, now), slot.supervisor.restarts,
                           worker.placement if worker else "local")
                for slot in self._slots if slot.index not in self.staffing.stopped]

    def _state(self, slot: Slot, now: float) -> SlotState:
        """A slot's state as reported: a leaving one reads DRAINING, BUSY past the paced hang limit HUNG."""
        if slot.index in self.staffing.leaving:
            return SlotState.DRAINING
        if slot.state is SlotState.BUSY and now - slot.busy_since > self.call_time.paced():
            return SlotState.HUNG
        return slot.state

    def dispatch(self, requests: list[Request], reason: str, now: float) -> Batch:
        """Hand a new batch to the lowest idle worker, else to the busy one nearest the end of
        its call (:meth:`openings`: the caller has checked there is one), whose pipe it waits in.

        ``now`` is the clock reading the batcher formed the batch at: its requests' deadlines
        were checked against it, so their dispatch time and queue wait are counted from it too
        (a loop busy failing expired requests may read the clock again milliseconds later)."""
        ending = None if self._idle else next(iter(self.openings().ahead_takers(now)), None)
        if not self._idle and ending is None:
            raise RuntimeError("dispatch needs an idle worker, or one ending its call")
        waits = self.counters.queue_wait
        for request in requests:
            request.dispatched_at = now
            waits[request.tier].observe(now - request.arrival)
        self.counters.batch_sizes.observe(len(requests))
        batch = Batch(next(self._batch_ids), requests, reason)
        if ending is None:
            self._send(self._idle.pop(0), batch)
        else:
            slot = self._slots[ending]
            slot.ahead = batch
            self._frame(slot, batch)
        return batch

    def cancelled(self, request: Request) -> None:
        """A dispatched request's caller has gone: if its batch waits in a worker's pipe, the
        worker is told to leave it out (else its output is dropped as it comes)."""
        for slot in self._slots:
            batch = slot.ahead
            if batch is not None and slot.sends is not None and request in batch.framed:
                slot.sends.send_nowait(Skip(batch.id, [batch.framed.index(request)]))
                return

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker, report started once all are ready, then supervise forever (one
        :class:`~batcher.core.supervisor.WorkerStartError` if any cannot start)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._retry.fail_overdue, self._calls_running)
            staffed = [slot.supervisor for slot in self._slots if slot.index not in self.staffing.stopped]
            await start_slots(nursery, staffed, self.config.model)
            task_status.started()

    # --- what a scaler does to the pool (batcher.core.scaling) ----------------------------------

    def report(self, decision: str) -> None:
        """The scaler's last decision that moved, for ``/readyz``."""
        self.staffing.scaling = decision

    def fleet(self) -> Fleet:
        """The workers by role, as the scaler plans with them."""
        counts = {"serving": 0, "starting": 0, "warm": 0, "warming": 0, "idle": 0}
        staffing = self.staffing
        for slot in self._slots:
            if slot.index in staffing.stopped | staffing.leaving:
                continue
            if slot.index in staffing.warm:
                counts["warm" if slot.state is SlotState.WARM else "warming"] += 1
            elif slot.state is SlotState.STARTING:
                counts["starting"] += 1
            else:
                counts["serving"] += 1
                counts["idle"] += slot.state is SlotState.IDLE
        return Fleet(**counts)

    def start(self, count: int, warm: bool = False) -> None:
        """Staff up to ``count`` stopped slots (lowest first), to serve or to be kept warm."""
        assert self._nursery is not None, "the pool runs"
        for index in self.staffing.next_stopped(count):
            slot = self._slots[index]
            slot.state = SlotState.STARTING
            self.staffing.started(index, trio.current_time(), warm)
            self._readiness.staffed(self.staffing.staffed)
            slot.supervisor.rehire()
            self._nursery.start_soon(self._staff, slot)

    def promote(self, count: int) -> None:
        """Up to ``count`` warm workers take work from now on (at once: they are ready)."""
        for slot in [s for s in self._slots if s.state is SlotState.WARM][:count]:
            self.staffing.warm.discard(slot.index)
            self._became_idle(slot)

    def retire(self, count: int) -> None:
        """Take ``count`` serving workers away: starting ones and idle ones stop now, busy ones
        drain (their call ends, then they stop); never a worker in a call."""
        away = self.staffing.stopped | self.staffing.warm | self.staffing.leaving
        states = [(s.index, s.state.value) for s in self._slots if s.index not in away]
        for index in leaving(states, count):
            slot = self._slots[index]
            self.staffing.leaving.add(index)
            if slot in self._idle:
                self._idle.remove(slot)
            if slot.state is not SlotState.BUSY:
                slot.supervisor.retire()

    async def _staff(self, slot: Slot) -> None:
        try:
            await slot.supervisor.run()
        except SlotStartError as exc:
            log.warning("%s: a worker added by the scaler did not start: %s", self.config.model, exc)
            self._stopped(slot)

    def _stopped(self, slot: Slot) -> None:
        """A slot's worker is gone for good (retired and reaped, or it never started): the slot is free."""
        slot.state = SlotState.STOPPED
        self.staffing.retired(slot.index)
        if slot in self._idle:
            self._idle.remove(slot)
        self._readiness.left(slot.index)
        self._readiness.staffed(self.staffing.staffed)

    async def _serve(self, slot: Slot, worker: Worker) -> bool:
        """Serve batches until the worker must die; True if it answered at least one call. Its
        frames go out in order through one task; a batch still waiting in its pipe when it
        dies goes to another worker, as one never delivered."""
        self.staffing.ready(slot.index, trio.current_time())
        sends, frames = trio.open_memory_channel[RunBatch | Skip](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_frames, worker, frames)
            slot.sends = sends
            try:
                answered = await self._calls(slot, worker)
            finally:
                slot.sends = None
                nursery.cancel_scope.cancel()
        if slot.ahead is not None:
            batch, slot.ahead = slot.ahead, None
            self._undelivered(slot, batch, "its worker stopped before the call")
        return answered

    async def _calls(self, slot: Slot, worker: Worker) -> bool:
        answered = False
        while not slot.supervisor.exited:
            batch, slot.ahead = slot.ahead, None
            if batch is None:
                with trio.CancelScope() as slot.idle_scope:
                    self._became_idle(slot)
                    batch = await slot.inbox.receive()
                if batch is None:
                    return answered  # it died while idle: nothing was lost
                if not batch.prune():
                    continue
                if slot.supervisor.exited:  # it died after this batch was handed to it
                    self._undelivered(slot, batch, "it had exited")
                    return answered
                self._frame(slot, batch)
            else:  # sent while the call before it ran: it has started in the worker already
                slot.busy_since = trio.current_time()
                self.on_idle()  # its pipe is empty again: it may take the next batch ahead
            started = trio.current_time()
            timeout = self.call_time.hang_limit(batch.hangs)
            slot.call, slot.call_ends = batch, started + timeout
            self._retry.called(batch, slot.call_ends)
            fault = None
            requests = batch.framed
            try:
                with trio.fail_after(timeout):
                    skipped, reply = await worker.reply(batch.id)
                requests = batch.ran(skipped)
                if reply.id != batch.id:
                    raise ProtocolError(f"answer to call {reply.id} while call {batch.id} ran")
            except NotDelivered as exc:
                self._undelivered(slot, batch, str(exc))
                return answered
            except trio.TooSlowError:
                fault, detail = "hung", f"no answer within {timeout:g}s"
                batch.hangs += 1
            except WorkerLost as exc:
                fault, detail = "crashed", str(exc)
            except ProtocolError as exc:
                fault, detail = "broke the protocol", str(exc)
            finally:
                slot.call = None
            self.counters.calls += 1
            self.counters.busy_seconds += trio.current_time() - started
            if fault is not None:
                log.warning("worker %d (pid %s) %s on batch %d of %d inputs (%s); restarting it",
                            slot.index, worker.pid, fault, batch.id, len(requests), detail)
                self._down(slot)
                batch.worker_faults += 1
                self._failed(batch, slot, f"a worker {fault}")
                return answered
            if error := reply_fault(reply, len(requests), self.outputs):
                log.warning("worker %d: %s on batch %d of %d inputs",
                            slot.index, error, batch.id, len(requests))
                self._failed(batch, slot, error)
            elif isinstance(reply, Result):  # an Error reply always has its fault
                answered = True
                now = trio.current_time()
                if requests:  # a call whose every input was skipped ran nothing: no call time
                    self._answered(len(requests), now - started)
                answers: Sequence[str | bytes] = reply.answers  # texts, or packed vectors
                for request, output in zip(requests, answers, strict=False):
                    request.finish(output, now)
        return answered

    def _frame(self, slot: Slot, batch: Batch) -> None:
        """Send a batch's call to the slot's worker (through its frames' task, in order)."""
        assert slot.sends is not None, "a slot takes batches while its worker serves"
        slot.sends.send_nowait(RunBatch(batch.id, batch.frame()))

    def _answered(self, size: int, seconds: float) -> None:
        self.call_time.answered(seconds)
        self._readiness.answered()
        self.on_answer(size, seconds)

    def _failed(self, batch: Batch, slot: Slot, error: str) -> None:
        """A call failed: a probe proved nothing (the next idle worker sends another); any other
        batch goes to the retry backlog, which an idle worker may take at once."""
        if batch.reason == "probe":
            batch.requests[0].fail(WorkersFailed(error), trio.current_time())
            return
        self._retry.failed(batch, slot.index, error, trio.current_time())
        self._offer_retries()

    def _undelivered(self, slot: Slot, batch: Batch, detail: str) -> None:
        """The worker was gone before the call reached it: the batch goes first to another
        worker, and the failure counts against neither its inputs nor this slot."""
        log.warning("worker %d was gone before batch %d reached it (%s); it goes to another worker",
                    slot.index, batch.id, detail)
        self._down(slot)
        self._retry.undelivered(batch)
        self._offer_retries()

    def _offer_retries(self) -> None:
        for idle in list(self._idle):
            if retry := self._retry_for(idle):
                self._idle.remove(idle)
                self._send(idle, retry)

    def _retry_for(self, slot: Slot) -> Batch | None:
        return self._retry.take(slot.index, self._others_up)

    def _others_up(self, failed_on: set[int]) -> bool:
        return any(self._taking(s) and s.index not in failed_on for s in self._slots)

    def _became_idle(self, slot: Slot) -> None:
        if slot.index in self.staffing.leaving:  # drained: its call has ended
            slot.state = SlotState.IDLE
            slot.supervisor.retire()
            return
        if slot.index in self.staffing.warm:
            slot.state = SlotState.WARM
            return
        if retry := self._retry_for(slot):
            self._send(slot, retry)
            return
        if not self._readiness.proven and self._probe is None:
            self._send(slot, self._probe_batch())
            return
        slot.state = SlotState.IDLE
        bisect.insort(self._idle, slot, key=lambda s: s.index)
        self.on_idle()

    def _probe_batch(self) -> Batch:
        """A call of one empty input, sent while the fleet is not ready and a worker idles: its
        answer makes the fleet ready without waiting for traffic that a load balancer would not
        send to a gateway that says it is not ready."""
        now = trio.current_time()
        probe = self._probe = Request(0, "", 0, now, math.inf, self._probed, RequestState.DISPATCHED)
        self.counters.probes += 1
        return Batch(next(self._batch_ids), [probe], "probe")

    def _probed(self, probe: Request) -> None:
        self._probe = None

    def _exited(self, slot: Slot) -> None:
        """The exit watch saw the worker die: an idle one stops waiting for work (a busy one's
        call fails on its own, as a crash or as undelivered)."""
        if slot.state in (SlotState.IDLE, SlotState.WARM):
            worker = slot.supervisor.worker
            assert worker is not None, "the exit watch watches a started worker"
            log.warning("worker %d (pid %s) died while idle; restarting it", slot.index, worker.pid)
            self._down(slot)
            slot.idle_scope.cancel()

    @staticmethod
    def _is_idle(slot: Slot) -> bool:
        return slot.state in (SlotState.IDLE, SlotState.WARM)

    def _down(self, slot: Slot) -> None:
        """The slot has no worker until its supervisor starts another: it takes no work. A
        leaving slot's worker is not replaced: the slot stops."""
        slot.state = SlotState.STARTING
        if slot.index in self.staffing.leaving:
            slot.supervisor.retire()  # its supervisor returns once the worker is reaped: _stopped
        else:
            self._readiness.lost(slot.index)
        if slot in self._idle:
            self._idle.remove(slot)

    def _calls_running(self) -> list[tuple[Batch, float]]:
        """Each call running now, with the time it counts as hung (what the backlog watches)."""
        return [(slot.call, slot.call_ends) for slot in self._slots if slot.call is not None]

    def _send(self, slot: Slot, batch: Batch) -> None:
        slot.state = SlotState.BUSY
        slot.busy_since = trio.current_time()
        slot.outbox.send_nowait(batch)


async def _send_frames(worker: Worker, frames: trio.MemoryReceiveChannel[RunBatch | Skip]) -> None:
    """A worker's frames, in the order the pool made them; once one finds the worker gone, the
    call waiting for its reply hears it (NotDelivered, or the crash of a call that ran)."""
    async for frame in frames:
        try:
            await worker.send(frame)
        except NotDelivered:
            return
