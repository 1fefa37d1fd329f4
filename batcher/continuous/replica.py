"""One engine replica as the pool sees it: what it was given, and its engine's frames as events.

A :class:`Replica` holds the jobs routed to it (:class:`~batcher.continuous.ticket.Ticket`\\ s):
queued in its tier queues on the gateway side, waiting to re-run after another replica died, or
live in its engine (sent as ``add``, known by their rid). A ticket's
:class:`~batcher.continuous.ticket.Stage` says which, and only this class's methods move a ticket
between them (its queues, its re-runs, its engine's live set, the prefill and free-block budgets
that go with it), so those counts cannot drift from the tickets.

While an engine lives, :meth:`Replica.serve` writes the frames the pool queued for it and
reads its frames back a step at a time (``batcher.continuous.engine_process``):

    tokens    the ticket's Output turns ids into events (a stream's deltas, or held text)
    finished  the rest of the text and Finished, or the error (too long for the cache)
    stats     the engine's load: free blocks for dispatch; the token rate for admission,
              measured while the replica is backlogged (work waits here or in its engine), so
              it is what the engine can do, not how little it was asked; and liveness: an
              engine that sends no stats for ``stats_timeout`` is killed
    step      a step it expects to be long has begun: the silence allowed until the next
              stats is that step's (``batcher.continuous.silence``)

Its :attr:`load` is the router's measure: the tokens it still owes its tickets, a ticket's
``remaining`` being its prompt not yet prefilled (less the prefix the replica holds) plus its
``max_tokens`` less what it has generated. Every change of a ticket's debt goes through
:meth:`owe`, so the sum never drifts.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import trio

from batcher.continuous.engine_process import EngineWorker
from batcher.continuous.handoff_phases import HandoffPause
from batcher.continuous.metrics import ContinuousCounters, ReplicaStats
from batcher.continuous.seat_wait import SeatBook
from batcher.continuous.silence import SilenceLimit
from batcher.continuous.ticket import Stage, Ticket, prompt_of
from batcher.continuous.token_load import TokenRate
from batcher.core.backend import Usage, WorkerStatus
from batcher.core.config import QueueConfig
from batcher.core.errors import RequestFailed, TooLarge
from batcher.core.supervisor import Supervisor
from batcher.core.tier_queue import TierQueues
from workers.protocol import (
    NO_ENGINE_STATS,
    Abort,
    Add,
    EngineStats,
    KvBlocks,
    KvExported,
    KvTaken,
    Message,
    ProtocolError,
    SequenceFinished,
    StepBegun,
    Tokens,
    WorkerLost,
    encode,
)

log = logging.getLogger("ferry.engines")

STOP_REASONS = {"eos": "end_turn", "stop_token": "end_turn", "max_tokens": "max_tokens"}
"""An engine's finish reasons as the Messages API's stop reasons."""


class Replica:
    """One engine worker slot and the tickets the pool gave it (see the module doc)."""

    def __init__(self, index: int, queue: QueueConfig, counters: ContinuousCounters,
                 on_change: Callable[[], None], on_answer: Callable[[], None]) -> None:
        self.index = index
        self.supervisor: Supervisor[EngineWorker]
        self.up = False
        self.queue: TierQueues[Ticket] = TierQueues(len(queue.tiers), queue.age_limit, queue.aged_share,
                                                    waiting=Stage.QUEUED, taken=Stage.PREFILLING,
                                                    weights=queue.weights, cost=prompt_of)
        self.reruns: deque[Ticket] = deque()  # lost by another replica: they go first
        self.live: dict[int, Ticket] = {}  # rid -> ticket, sent to the engine
        self.seated = SeatBook()  # the live tickets, summed for the seat wait
        self.load = 0
        self.prefilling = 0  # prompt tokens sent with no token back yet
        self.free_blocks = 0  # the engine's last report, less the blocks of what was sent since
        self.total_blocks = 0
        self.stats: EngineStats | None = None
        self.stats_at = 0.0
        self.silence = SilenceLimit(math.inf, math.inf)  # set as an engine is served
        self.silent_at = math.inf  # its engine is killed if it has not been heard from by then
        self.busy = False  # it had a backlog at its last report (work its engine could not start)
        self.computed, self.generated = TokenRate(), TokenRate()
        self.carried = NO_ENGINE_STATS  # the counters of its engines that died
        self.served = False
        self._pool_counters, self._on_change, self._on_answer = counters, on_change, on_answer
        self._outbox: list[bytes] = []
        self._outbox_ready = trio.Event()
        self._handing: list[HandoffPause] = []  # the hand-offs in the outbox
        self.on_handoff: Callable[[Replica, Message], None] | None = None  # a prefill replica's kv frames

    def owe(self, ticket: Ticket, tokens: int) -> None:
        """``ticket`` is now owed ``tokens`` here (0: it left)."""
        self.load += tokens - ticket.remaining
        if self.live.get(ticket.rid) is ticket:
            self.seated.owed += tokens - ticket.remaining
        ticket.remaining = tokens

    # --- the tickets given to it ---------------------------------------------------------

    def enqueue(self, ticket: Ticket) -> None:
        """Queue ``ticket`` in its tier, owing its cost here."""
        ticket.state = Stage.QUEUED
        self.queue.push(ticket)
        self.owe(ticket, ticket.cost)

    def leave(self, ticket: Ticket) -> None:
        """A ticket waiting here (queued, or to re-run) leaves for good (cancelled): it owes
        nothing here, and a re-run is skipped when it reaches the front."""
        queued = ticket.state is Stage.QUEUED
        ticket.state = Stage.ENDED
        if queued:
            self.queue.discard(ticket)
        self.owe(ticket, 0)

    def expire(self, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """The queued tickets past their deadline, and the re-runs no engine took in time: each
        ended here, owing nothing (their callers are the pool's to tell)."""
        expired = self.queue.expire(now)
        timed_out = [t for t in self.reruns if t.state is Stage.RERUN and t.rerun_due <= now]
        for ticket in (*expired, *timed_out):
            ticket.state = Stage.ENDED
            self.owe(ticket, 0)
        return expired, timed_out

    def next_deadline(self) -> float:
        """When the next ticket waiting here expires or times out (inf: none will)."""
        reruns = (t.rerun_due for t in self.reruns if t.state is Stage.RERUN)
        return min(self.queue.next_deadline(), min(reruns, default=math.inf))

    def evacuate(self, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """Its engine is gone: the re-runs and the queued tickets waiting here, taken out
        owing nothing, for the pool to place elsewhere."""
        reruns = [t for t in self.reruns if t.state is Stage.RERUN]
        self.reruns.clear()
        queued = self.queue.take(self.queue.count, now)
        for ticket in (*reruns, *queued):
            self.owe(ticket, 0)
        return reruns, queued

    def queue_rerun(self, ticket: Ticket) -> None:
        """Put a ticket lost with another engine first in this replica's work."""
        ticket.state = Stage.RERUN
        self.owe(ticket, ticket.cost)
        self.reruns.append(ticket)

    def next_ticket(self, now: float) -> Ticket | None:
        """The next ticket to start here: a re-run first, then the queues by tier; None if none."""
        while self.reruns:
            ticket = self.reruns.popleft()
            if ticket.state is Stage.RERUN:
                return ticket
        taken = self.queue.take(1, now)
        return taken[0] if taken else None

    def can_start(self, max_seqs: int, prefill_budget: int) -> bool:
        """Whether its engine can start one more sequence soon: fewer than ``max_seqs`` live,
        less than ``prefill_budget`` prompt tokens not yet prefilled, free blocks left."""
        return len(self.live) < max_seqs and self.prefilling < prefill_budget and self.free_blocks > 0

    def start(self, ticket: Ticket, add: Add, blocks: int, now: float) -> None:
        """Send ``ticket`` to the engine as ``add``, holding ``blocks`` of its free ones."""
        ticket.state, ticket.rid, ticket.dispatched_at = Stage.PREFILLING, add.rid, now
        ticket.rerun_due = math.inf
        self._sit(ticket)
        ticket.prefill = len(add.prompt_tokens) + len(add.output_tokens)
        self.prefilling += ticket.prefill
        self.free_blocks -= blocks
        self.owe(ticket, ticket.cost)
        self.send(add)

    def release(self, rid: int) -> Ticket | None:
        """Sequence ``rid`` left the engine for another (a hand-off): its ticket, owing nothing
        here, or None if it has ended (its caller went away)."""
        ticket = self._unseat(rid)
        if ticket is None:
            return None
        self._prefilled(ticket)
        self.owe(ticket, 0)
        return None if ticket.ended else ticket

    def receive(self, ticket: Ticket, frames: list[Message], blocks: int, now: float) -> None:
        """``ticket``, prefilled elsewhere, is decoded here from the KV in ``frames``, holding
        ``blocks`` of its free ones."""
        ticket.replica, ticket.state = self.index, Stage.RUNNING
        if ticket.handoff is not None:
            ticket.handoff.handed_at = now
            self._handing.append(ticket.handoff)
        self._sit(ticket)
        self.free_blocks -= blocks
        self.owe(ticket, max(0, ticket.job.max_tokens - ticket.out.generated))
        for frame in frames:
            self.send(frame)

    def end(self, ticket: Ticket) -> None:
        """The caller of a live ticket has gone, or its answer is complete: its sequence is
        aborted (its blocks are free before the engine's next step)."""
        self._prefilled(ticket)
        ticket.state = Stage.ENDED
        self.send(Abort(ticket.rid))

    def _sit(self, ticket: Ticket) -> None:
        self.live[ticket.rid] = ticket
        job = ticket.job
        self.seated.sit(ticket.tier, ticket.tenant, len(job.prompt_tokens) + job.max_tokens, ticket.remaining)

    def _unseat(self, rid: int) -> Ticket | None:
        ticket = self.live.pop(rid, None)
        if ticket is not None:
            job = ticket.job
            self.seated.leave(ticket.tier, ticket.tenant, len(job.prompt_tokens) + job.max_tokens,
                              ticket.remaining)
        return ticket

    def _prefilled(self, ticket: Ticket) -> None:
        if ticket.state is Stage.PREFILLING:
            ticket.state = Stage.RUNNING
            self.prefilling -= ticket.prefill

    def send(self, message: Message) -> None:
        self._outbox.append(encode(message))
        self._outbox_ready.set()

    # --- while an engine lives ---------------------------------------------------------

    async def serve(self, worker: EngineWorker, silence: SilenceLimit) -> bool:
        """Talk to a started engine until it must die (silent past ``silence``); True if it
        finished a sequence."""
        first = worker.first_stats
        self.up, self.served, self._outbox, self.silence, self._handing = True, False, [], silence, []
        self.stats, self.stats_at, self.busy = first, trio.current_time(), False
        self.silent_at = self.stats_at + silence.stats_timeout
        self.free_blocks, self.total_blocks = first.free_blocks, first.total_blocks
        self.computed.restart()
        self.generated.restart()
        self._on_change()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, worker)
                await self._read(worker)
                nursery.cancel_scope.cancel()
        except* (WorkerLost, ProtocolError) as group:
            log.warning(
                "engine %d (pid %s) lost: %s; restarting it", self.index, worker.pid, group.exceptions[0]
            )
        return self.served

    def down(self) -> list[Ticket]:
        """The engine is gone: forget its state; the live tickets it took with it."""
        if self.stats is not None:
            self.carried = self.carried.plus_counters(self.stats)
        self.up, self.stats, self._outbox, self._handing, self.prefilling = False, None, [], [], 0
        lost, self.live = list(self.live.values()), {}
        self.seated.clear()
        for ticket in lost:
            self.owe(ticket, 0)
        return lost

    async def _write(self, worker: EngineWorker) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            frames, self._outbox = self._outbox, []
            handing, self._handing = self._handing, []
            await worker.send(b"".join(frames))
            for handoff in handing:
                handoff.sent(trio.current_time())

    async def _read(self, worker: EngineWorker) -> None:
        while True:
            with trio.move_on_at(self.silent_at):
                messages = await worker.receive()
                self._step(messages, trio.current_time())
                continue
            log.warning("engine %d (pid %s) sent no stats for %.1fs, past its limit: killing it",
                        self.index, worker.pid, trio.current_time() - self.stats_at)
            return

    def _step(self, messages: list[Message], now: float) -> None:
        """One read's frames (a step's, or several): every event they cause, in one pass."""
        for message in messages:
            if isinstance(message, Tokens):
                self._tokens(message)
            elif isinstance(message, SequenceFinished):
                self._finished(message)
            elif isinstance(message, EngineStats):
                self._report(message, now)
            elif isinstance(message, StepBegun):
                self.silent_at = now + self.silence.of_step(message.seconds)
            elif isinstance(message, KvBlocks | KvExported) and self.on_handoff is not None:
                self.on_handoff(self, message)
            elif isinstance(message, KvTaken):
                self._taken(message, now)
            else:
                raise ProtocolError(f"unexpected {message.kind} frame from an engine")
        self._on_change()

    def _tokens(self, frame: Tokens) -> None:
        ticket = self.live.get(frame.rid)
        if ticket is None or ticket.ended:
            return
        job = ticket.job
        self._prefilled(ticket)
        pause = None if ticket.handoff is None else ticket.handoff.first_token(trio.current_time())
        if pause is not None:  # the first token since its hand-off
            self._pool_counters.handoff_seconds.observe(pause)
            self._settle(ticket)
        self.queue.charge(ticket.tier, ticket.tenant, len(frame.ids))  # its share: answer tokens as made
        if ticket.out.push(frame.ids, ticket.queued):  # a whole answer reached a stop sequence
            self.end(ticket)
            usage = Usage(len(job.prompt_tokens), cached_tokens=0, output_tokens=ticket.out.generated)
            ticket.out.finish("end_turn", usage, ticket.queued)
        self.owe(ticket, max(0, job.max_tokens - ticket.out.generated))

    def _taken(self, frame: KvTaken, now: float) -> None:
        ticket = self.live.get(frame.rid)
        if ticket is not None and ticket.handoff is not None:
            ticket.handoff.take(frame, now)
            self._settle(ticket)

    def _settle(self, ticket: Ticket) -> None:
        """Count the parts of ``ticket``'s hand-off once they are all known."""
        if ticket.handoff is not None and ticket.handoff.settle(self._pool_counters.handoff_phases):
            ticket.handoff = None

    def _finished(self, frame: SequenceFinished) -> None:
        ticket = self._unseat(frame.rid)
        if ticket is None:
            return
        self._prefilled(ticket)
        self.owe(ticket, 0)
        self.served = True
        self._on_answer()
        if ticket.ended:
            return
        ticket.state = Stage.ENDED
        if frame.reason in STOP_REASONS:
            ticket.out.finish(STOP_REASONS[frame.reason], frame.usage, ticket.queued)
        elif frame.reason == "too_long":
            ticket.out.fail(TooLarge(f"the request outgrew the KV cache of its replica ({self.total_blocks} "
                                     "blocks) while it ran"), retryable=False)
        else:
            ticket.out.fail(RequestFailed(f"the engine ended the request ({frame.reason})"), retryable=True)

    def _report(self, stats: EngineStats, now: float) -> None:
        last = self.stats
        if last is not None and stats.step > last.step:
            steps = stats.step - last.step
            self._pool_counters.step_tokens.observe(
                (stats.computed_tokens - last.computed_tokens) / steps, steps
            )
        busy = stats.waiting > 0 or self.queue.count + len(self.reruns) > 0  # backlogged: saturated
        self.computed.update(now, stats.computed_tokens, busy and self.busy)
        self.generated.update(now, stats.generated_tokens)
        self.stats, self.stats_at, self.busy, self.free_blocks = stats, now, busy, stats.free_blocks
        self.silent_at = now + self.silence.stats_timeout

    # --- what /readyz and /metrics show ------------------------------------------------

    def status(self) -> WorkerStatus:
        worker = self.supervisor.worker
        engine = (
            {
                **{name: getattr(self.stats, name)
                   for name in ("running", "waiting", "used_blocks", "free_blocks", "total_blocks")},
                "stats_age_ms": round((trio.current_time() - self.stats_at) * 1000),  # since that report
            }
            if self.stats
            else {}
        )
        pid = worker.pid if self.up and worker else None
        details = {"queued": self.queue.count + len(self.reruns), "load_tokens": self.load, **engine}
        state = "up" if self.up else "starting"
        placement = worker.placement if worker else "local"
        return WorkerStatus(self.index, pid, state, self.supervisor.restarts, details, placement)

    def replica_stats(self) -> ReplicaStats:
        engine = self.stats.plus_counters(self.carried) if self.stats else self.carried
        return ReplicaStats(self.index, self.total_blocks, self.generated.value if self.up else 0.0, engine)
