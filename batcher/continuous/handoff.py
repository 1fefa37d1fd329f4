"""The pool's part of the prefill -> decode hand-off: a sequence's KV from a prefill replica to a
decode replica, and its ticket with it.

A model with ``prefill_workers = P`` and ``decode_workers = D`` has P + D replicas: the first P
prefill (the router sends every new job, re-run and resumed stream there), the other D decode.
A prefill engine streams a sequence's first token as any engine does, then its KV (``kv``
frames) and ``kv_exported``; the sequence has left that engine. The pool then::

    kv frames            kept, by rid, until the sequence's kv_exported arrives
    kv_exported          the ticket leaves its prefill replica; a decode replica is chosen
                         (up, a seat and free blocks for the sequence by its last report, least
                         load; else the least loaded one up: its engine computes the sequence
                         again if it has no room); the kv frames and a kv_handoff go there;
                         with no decode replica up, they wait here for one (its client waits)

From then on the decode replica streams the rest: one stream to the client. Nothing is lost in
between: until ``kv_exported`` arrives the ticket is its prefill replica's, whose death applies
the pool's rule for a lost engine (``on_engine_loss``) to what the client has seen; after, it is
the decode replica's, and the same rule applies there. A hand-off waiting for a decode engine
(every one is restarting) waits as long as an admitted job may, then fails (500, as a re-run
no engine takes). While one waits the prefill replicas start no new sequence (:attr:`stalled`),
so the bytes held here are at most what their engines held when the decode replicas went down,
not their output over the whole wait. A ticket cancelled meanwhile is dropped with its bytes:
with a shared-memory hand-off (``manifest.segment``, engines on the pool's host) the pool
unlinks its segment then, as it does for one that waited past its time.

The cost is counted per hand-off: the bytes moved, and the seconds from the hand-off reaching
a decode replica to that replica's next token (the transfer, the import and one decode step:
the pause the hand-off adds to the stream), and that pause's parts
(:mod:`batcher.continuous.handoff_phases`); the ``ferry_engine_kv_handoff_*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import trio

from batcher.continuous.handoff_phases import HandoffPause
from batcher.continuous.metrics import ContinuousCounters
from batcher.continuous.replica import Replica
from batcher.continuous.ticket import Stage, Ticket
from batcher.core.errors import WorkersFailed
from workers.kv_manifest import discard, segment_name
from workers.protocol import Add, KvBlocks, KvExported, KvHandoff, Message


class Waiting(NamedTuple):
    """A hand-off that found no decode replica up: its frames, its blocks, until when it waits."""

    ticket: Ticket
    frames: list[Message]
    blocks: int
    due: float
    segment: str  # its shared-memory segment ("": its bytes are in frames)


class Handoffs:
    """Hand-offs from the prefill replicas to ``decoders`` (see the module doc). ``add`` is the
    ``add`` frame of a ticket under a rid; ``patience`` how long a ticket of a tier may wait."""

    def __init__(self, decoders: Sequence[Replica], max_seqs: int, block_size: int,
                 counters: ContinuousCounters, add: Callable[[Ticket, int], Add],
                 patience: Callable[[int], float]) -> None:
        self.decoders, self.max_seqs, self.block_size = decoders, max_seqs, block_size
        self.counters, self._add, self._patience = counters, add, patience
        self._chunks: dict[int, list[KvBlocks]] = {}  # rid -> its kv frames so far
        self._waiting: list[Waiting] = []

    @property
    def stalled(self) -> bool:
        """A hand-off waits for a decode replica: the prefill replicas start nothing new meanwhile."""
        return bool(self._waiting)

    def take(self, prefill: Replica, message: Message) -> None:
        """A hand-off frame from ``prefill``'s engine."""
        if isinstance(message, KvBlocks):
            self._chunks.setdefault(message.rid, []).append(message)
        elif isinstance(message, KvExported):
            self._hand(prefill, message)

    def forget(self, replica: Replica, tickets: Sequence[Ticket]) -> None:
        """``replica``'s engine died under ``tickets``: the bytes of their sequences will not be
        used. Their frames held here go; so do the shared-memory segments a decode engine was
        handed and may not have read, and those a prefill engine of this host may have written
        and not yet announced (the names it would have given them)."""
        worker = replica.supervisor.worker
        pid = worker.pid if worker is not None and worker.placement == "local" else None
        for ticket in tickets:
            self._chunks.pop(ticket.rid, None)
            discard(ticket.segment)
            if pid is not None:
                discard(segment_name(pid, ticket.rid))

    def _hand(self, prefill: Replica, exported: KvExported) -> None:
        chunks = self._chunks.pop(exported.rid, [])
        ticket = prefill.release(exported.rid)
        if ticket is None:  # cancelled while it prefilled: its sequence has left that engine too
            discard(exported.manifest.segment)
            return
        blocks = -(-(exported.manifest.kv_tokens + 1) // self.block_size)
        handoff = KvHandoff(self._add(ticket, exported.rid), exported.manifest)
        manifest = exported.manifest
        self.counters.handoff_bytes.observe(manifest.blocks * manifest.block_bytes)  # frames or segment
        now = trio.current_time()
        ticket.handoff = HandoffPause(now, exported.seconds)
        self._waiting.append(Waiting(ticket, [*chunks, handoff], blocks, now + self._patience(ticket.tier),
                                     exported.manifest.segment))
        self.flush(now)

    def flush(self, now: float) -> float:
        """Send the waiting hand-offs to a decode replica, if one is up, and fail those past
        their time; when the next one still waiting is due (inf: none waits)."""
        waiting, self._waiting = self._waiting, []
        for handoff in waiting:
            ticket = handoff.ticket
            decoder = None if ticket.ended else self._decoder(handoff.blocks)
            if decoder is not None:
                ticket.segment = handoff.segment
                decoder.receive(ticket, handoff.frames, handoff.blocks, now)
            elif ticket.ended or handoff.due <= now:
                discard(handoff.segment)
                if not ticket.ended:
                    ticket.state = Stage.ENDED
                    self.counters.timed_out += 1
                    ticket.out.fail(WorkersFailed("no decode engine took the request in time"), False)
            else:
                self._waiting.append(handoff)
        return min((handoff.due for handoff in self._waiting), default=math.inf)

    def _decoder(self, blocks: int) -> Replica | None:
        """The decode replica for a sequence of ``blocks`` blocks (see the module doc)."""
        up = [r for r in self.decoders if r.up]
        roomy = [r for r in up if len(r.live) < self.max_seqs and r.free_blocks >= blocks]
        return min(roomy or up, key=lambda r: (r.load, r.index), default=None)
