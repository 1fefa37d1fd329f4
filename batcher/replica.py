"""One engine replica as the pool sees it: what it was given, and its engine's frames as events.

A :class:`Replica` holds the jobs routed to it (:class:`Ticket`\\ s): queued in its tier queues
on the gateway side, waiting to re-run after another replica died, or live in its engine (sent
as ``add``, known by their rid). While an engine lives, :meth:`Replica.serve` writes the frames
the pool queued for it and reads its frames back a step at a time (``batcher.engine_worker``):

    tokens    the ticket's Output turns ids into events (a stream's deltas, or held text)
    finished  the rest of the text and Finished, or the error (too long for the cache)
    stats     the engine's load: free blocks for dispatch; the token rate for admission,
              measured while the replica is backlogged (work waits here or in its engine), so
              it is what the engine can do, not how little it was asked; and liveness: an
              engine that sends no stats for ``stats_timeout`` is killed

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

from batcher.backend import Job, Usage
from batcher.config import QueueConfig
from batcher.engine_metrics import COUNTERS, ContinuousStats, ReplicaStats
from batcher.engine_worker import EngineProcess
from batcher.supervisor import Supervisor
from batcher.tier_queue import TierQueues
from batcher.token_load import TokenRate
from batcher.token_stream import Output
from batcher.types import Request, RequestFailed, TooLarge
from workers.protocol import Abort, Add, Finished, Message, ProtocolError, Stats, Tokens, WorkerLost, encode

log = logging.getLogger("ferry.engines")

STOP_REASONS = {"eos": "end_turn", "stop_token": "end_turn", "max_tokens": "max_tokens"}
"""An engine's finish reasons as the Messages API's stop reasons."""


class Ticket:
    """One submitted job and where it stands: what :meth:`EnginePool.submit` returns."""

    __slots__ = (
        "arrival",
        "attempts",
        "closed",
        "cost",
        "deadline",
        "dispatched_at",
        "hashes",
        "out",
        "prefilling",
        "remaining",
        "replica",
        "request",
        "rerun_due",
        "rid",
        "tier",
    )

    def __init__(self, out: Output, tier: int, arrival: float, deadline: float, hashes: list[bytes]) -> None:
        self.out, self.tier, self.arrival, self.deadline, self.hashes = out, tier, arrival, deadline, hashes
        self.cost = 0  # tokens it adds where it waits: prompt not held by its replica + max_tokens
        self.replica = -1
        self.request: Request | None = None  # its place in its replica's tier queues, while queued
        self.rid = -1  # its sequence's number in the engine, once sent
        self.dispatched_at = arrival
        self.remaining = 0  # tokens its replica owes it (see the module doc)
        self.prefilling = False  # sent, and no token back yet
        self.attempts = 0  # times an engine died under it
        self.rerun_due = math.inf  # a re-run that no engine takes by then fails
        self.closed = False  # its caller has had its last event, or has gone

    @property
    def job(self) -> Job:
        return self.out.job

    @property
    def queued(self) -> float:
        """Seconds it waited in the pool before its engine got it."""
        return self.dispatched_at - self.arrival


class Replica:
    """One engine worker slot and the tickets the pool gave it (see the module doc)."""

    def __init__(self, index: int, queue: QueueConfig, stats: ContinuousStats, on_change: Callable[[], None],
                 on_answer: Callable[[], None]) -> None:
        self.index = index
        self.supervisor: Supervisor[EngineProcess]
        self.up = False
        self.queue = TierQueues(len(queue.tiers), queue.age_limit, queue.aged_share)
        self.waiting: dict[int, Ticket] = {}  # request id -> ticket, in the tier queues
        self.reruns: deque[Ticket] = deque()  # lost by another replica: they go first
        self.live: dict[int, Ticket] = {}  # rid -> ticket, sent to the engine
        self.load = 0
        self.prefilling = 0  # prompt tokens sent with no token back yet
        self.free_blocks = 0  # the engine's last report, less the blocks of what was sent since
        self.total_blocks = 0
        self.stats: Stats | None = None
        self.stats_at = 0.0
        self.busy = False  # it had a backlog at its last report (work its engine could not start)
        self.computed, self.generated = TokenRate(), TokenRate()
        self.carried = dict.fromkeys(COUNTERS, 0)  # counters of its engines that died
        self.served = False
        self._pool_stats, self._on_change, self._on_answer = stats, on_change, on_answer
        self._outbox: list[bytes] = []
        self._outbox_ready = trio.Event()

    def owe(self, ticket: Ticket, tokens: int) -> None:
        """``ticket`` is now owed ``tokens`` here (0: it left)."""
        self.load += tokens - ticket.remaining
        ticket.remaining = tokens

    def send(self, message: Add | Abort) -> None:
        self._outbox.append(encode(message))
        self._outbox_ready.set()

    # --- while an engine lives ---------------------------------------------------------

    async def serve(self, worker: EngineProcess, stats_timeout: float) -> bool:
        """Talk to a started engine until it must die; True if it finished a sequence."""
        first = worker.first_stats
        self.up, self.served, self._outbox = True, False, []
        self.stats, self.stats_at, self.busy = first, trio.current_time(), False
        self.free_blocks, self.total_blocks = first.free_blocks, first.total_blocks
        self.computed.restart()
        self.generated.restart()
        self._on_change()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, worker)
                await self._read(worker, stats_timeout)
                nursery.cancel_scope.cancel()
        except* (WorkerLost, ProtocolError) as group:
            log.warning("engine %d (pid %s) lost: %s; restarting it", self.index, worker.pid, group.exceptions[0])
        return self.served

    def down(self) -> list[Ticket]:
        """The engine is gone: forget its state; the live tickets it took with it."""
        if self.stats is not None:
            for name in COUNTERS:
                self.carried[name] += getattr(self.stats, name)
        self.up, self.stats, self._outbox, self.prefilling = False, None, [], 0
        lost, self.live = list(self.live.values()), {}
        for ticket in lost:
            self.owe(ticket, 0)
        return lost

    async def _write(self, worker: EngineProcess) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            frames, self._outbox = self._outbox, []
            await worker.send(b"".join(frames))

    async def _read(self, worker: EngineProcess, timeout: float) -> None:
        while True:
            with trio.move_on_at(self.stats_at + timeout):
                messages = await worker.receive()
                self._step(messages, trio.current_time())
                continue
            log.warning("engine %d (pid %s) sent no stats for %.1fs: killing it", self.index, worker.pid, timeout)
            return

    def _step(self, messages: list[Message], now: float) -> None:
        """One read's frames (a step's, or several): every event they cause, in one pass."""
        for message in messages:
            if isinstance(message, Tokens):
                self._tokens(message)
            elif isinstance(message, Finished):
                self._finished(message)
            elif isinstance(message, Stats):
                self._report(message, now)
            else:
                raise ProtocolError(f"unexpected {message.kind} frame from an engine")
        self._on_change()

    def _tokens(self, frame: Tokens) -> None:
        ticket = self.live.get(frame.rid)
        if ticket is None or ticket.closed:
            return
        job = ticket.job
        if ticket.prefilling:
            ticket.prefilling = False
            self.prefilling -= len(job.prompt_tokens)
        if ticket.out.push(frame.ids, ticket.queued):  # a whole answer reached a stop sequence
            ticket.closed = True
            self.send(Abort(frame.rid))
            ticket.out.finish("end_turn", Usage(len(job.prompt_tokens), ticket.out.generated), ticket.queued)
        self.owe(ticket, max(0, job.max_tokens - ticket.out.generated))

    def _finished(self, frame: Finished) -> None:
        ticket = self.live.pop(frame.rid, None)
        if ticket is None:
            return
        if ticket.prefilling:
            self.prefilling -= len(ticket.job.prompt_tokens)
        self.owe(ticket, 0)
        self.served = True
        self._on_answer()
        if ticket.closed:
            return
        ticket.closed = True
        usage = frame.usage
        if frame.reason in STOP_REASONS:
            stop = STOP_REASONS[frame.reason]
            ticket.out.finish(stop, Usage(usage.prompt_tokens, usage.output_tokens, usage.cached_tokens), ticket.queued)
        elif frame.reason == "too_long":
            ticket.out.fail(TooLarge(f"the request outgrew the KV cache of its replica ({self.total_blocks} "
                                     "blocks) while it ran"), retryable=False)
        else:
            ticket.out.fail(RequestFailed(f"the engine ended the request ({frame.reason})"), retryable=True)

    def _report(self, stats: Stats, now: float) -> None:
        last = self.stats
        if last is not None and stats.step > last.step:
            steps = stats.step - last.step
            self._pool_stats.step_tokens.observe((stats.computed_tokens - last.computed_tokens) / steps, steps)
        busy = stats.waiting > 0 or self.queue.count + len(self.reruns) > 0  # backlogged: saturated
        self.computed.update(now, stats.computed_tokens, busy and self.busy)
        self.generated.update(now, stats.generated_tokens)
        self.stats, self.stats_at, self.busy, self.free_blocks = stats, now, busy, stats.free_blocks

    # --- what /readyz and /metrics show ------------------------------------------------

    def status(self) -> dict:
        worker = self.supervisor.worker
        engine = {name: getattr(self.stats, name) for name in ("running", "waiting", "used_blocks", "free_blocks",
                                                                "total_blocks")} if self.stats else {}
        return {"slot": self.index, "pid": worker.pid if self.up and worker else None,
                "placement": worker.placement if worker else "local",
                "state": "up" if self.up else "starting", "restarts": self.supervisor.restarts,
                "queued": self.queue.count + len(self.reruns), "load_tokens": self.load, **engine}

    def replica_stats(self) -> ReplicaStats:
        now = self.stats
        counters = {name: self.carried[name] + (getattr(now, name) if now else 0) for name in COUNTERS}
        gauges = {name: getattr(now, name) if now else 0
                  for name in ("running", "waiting", "free_blocks", "used_blocks", "cached_blocks")}
        return ReplicaStats(self.index, self.total_blocks, self.generated.value if self.up else 0.0,
                            **gauges, **counters)
