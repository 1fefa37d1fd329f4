"""Which tokens of which sequences the next step computes: one budget, no phases. Pure.

Theory of operation. Each step has ``max_batch_tokens`` to spend. Running sequences come first,
in priority order (tier, then arrival): a decode costs one token, a sequence still prefilling
takes a chunk of what is left, less one token for each decode behind it, so a 50,000-token
prompt advances ~500 tokens a step while every running decode still gets its token. Then, with
what is left, waiting sequences are admitted by tier (0, paid, before 1, free), preempted ones
first, then by the tenants' fair shares (:mod:`workers.shares`: uncached prompt and answer
tokens; one tenant is FIFO), each with a first chunk that fits the budget and the watermark::

    budget 512   [ A decode 1 ][ B last 400 of its prompt ][ C decode 1 ][ D admitted: first 110 ]
                  running, tier then arrival order ...........................   waiting, by tier

When a running sequence's next tokens find no free block, the scheduler preempts by recompute
the lowest-tier, newest running sequence (the last in priority order; possibly the one asking):
its blocks go back (its full blocks stay cached, so its recompute is mostly prefix hits), its
tokens stay, and it returns to the head of its tier's queue. A prompt chunk with nobody left to
preempt shrinks to the room there is instead. A step that preempted admits nothing: memory is
short, a new sequence would only be preempted in turn. A sequence alone in the cache that still
cannot grow would loop forever; it ends with ``TOO_LONG`` instead, as does a prompt longer than
the whole cache or than the model's context, on arrival.

**Seats.** A waiting sequence takes a seat only while fewer than ``max_seqs`` run and, with a
step-cost model, while the decode step of the running sequences and it stays within the
strictest time-per-output-token target among them (:mod:`workers.engine.seats`). One that finds
no seat may take one from a running sequence of a lower tier, or of a tenant of its own tier
further over its share of the seats (preempted by recompute, back among the waiting of its
tenant); else it waits, and nothing of its tier or below passes it. While the waiting can take no
seat, the running sequences' decodes still run as one :class:`DecodeRun`.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple

from workers.engine.block_manager import BlockManager, cdiv
from workers.engine.config import EngineConfig
from workers.engine.cost_model import CostModel
from workers.engine.decode_run import DecodeRun
from workers.engine.seats import Seats, who_yields
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.shares import FairQueue


class Schedule(NamedTuple):
    """One step's decision: ``seqs[i]`` computes its next ``num_tokens[i]`` tokens; ``run`` is
    set when the step is a pure decode of a :class:`~workers.engine.decode_run.DecodeRun`.
    (A named tuple: immutable, and cheap to make.)"""

    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence]
    run: DecodeRun | None = None


def priority(seq: Sequence) -> tuple[int, float, int]:
    return seq.tier, seq.arrival, seq.rid


def _tenant(seq: Sequence) -> str:
    return seq.tenant


def _waits(seq: Sequence) -> bool:
    return seq.status is SequenceStatus.WAITING


def _prompt(seq: Sequence) -> float:
    return seq.num_prompt


class Scheduler:
    """``max_model_len`` is the model's context: a sequence never holds more tokens (it ends
    with ``MAX_TOKENS`` there), and a prompt that leaves no room for one token ends ``TOO_LONG``
    on arrival. None: no limit but the cache's. ``cost`` prices steps for the sequences' TPOT
    targets (None: targets are not held, seats are ``max_seqs``)."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.watermark_blocks, config.model_version
        )
        self.waiting: dict[int, FairQueue[Sequence]] = {}  # tier -> its tenants' shares
        self.resumed: dict[int, deque[Sequence]] = {}  # tier -> preempted sequences, the latest first
        self.weights: dict[str, float] = {}  # tenant -> its weight, as its last sequence said
        self.running: list[Sequence] = []  # in priority order
        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by rid
        self.finished: list[Sequence] = []  # finished since the engine last took them
        self.details: dict[int, str] = {}  # rid -> why a sequence ended the way it did, where it needs saying
        self.preemptions = 0
        self.seats = Seats(cost, max_model_len) if cost is not None else None
        self._run: DecodeRun | None = None  # the running sequences' run of decodes, while it lasts

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values()) + sum(map(len, self.resumed.values()))

    def queued(self, tier: int) -> list[Sequence]:
        """The sequences waiting in ``tier``: the preempted ones, then the others by tenant."""
        return [*self.resumed.get(tier, ()), *self.waiting.get(tier, ())]

    def _queue(self, tier: int) -> FairQueue[Sequence]:
        queue = self.waiting.get(tier)
        if queue is None:
            queue = self.waiting[tier] = FairQueue(self.weights, _tenant, _waits, _prompt)
            self.resumed[tier] = deque()
        return queue

    def add(self, seq: Sequence) -> None:
        if seq.rid in self.sequences:
            raise ValueError(f"rid {seq.rid}: already in the engine")
        self._run = None
        self.sequences[seq.rid] = seq
        needed = cdiv(seq.num_tokens, self.config.block_size)  # a resumed one's output too
        if self.max_model_len is not None and seq.num_prompt >= self.max_model_len:
            detail = (
                f"a prompt of {seq.num_prompt} tokens leaves no room in the model's context "
                f"of {self.max_model_len}"
            )
            self.finish(seq, FinishReason.TOO_LONG, seq.arrival, detail)
        elif needed > self.config.num_blocks:
            self.finish(seq, FinishReason.TOO_LONG, seq.arrival, self._too_long(needed))
        else:
            if self.weights.get(seq.tenant, 1.0) != seq.weight:
                self.weights[seq.tenant] = seq.weight
                for queue in self.waiting.values():
                    queue.reweigh(self.weights)
            self._queue(seq.tier).push(seq)

    def abort(self, rid: int, now: float) -> bool:
        """End ``rid`` and free its blocks now; False if no such sequence is in the engine."""
        seq = self.sequences.get(rid)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.resumed[seq.tier]:  # a waiting sequence preempted for memory
            self.resumed[seq.tier].remove(seq)
        else:
            self.waiting[seq.tier].forget(seq)
        self.finish(seq, FinishReason.ABORTED, now)
        return True

    def release(self, seq: Sequence) -> None:
        """A running ``seq`` leaves for another engine (a prefill -> decode hand-off): out of the
        engine, its tokens charged to its tenant, its blocks freed (the full ones stay cached)."""
        self.running.remove(seq)
        self._charge(seq)
        self.blocks.free_blocks(seq)
        self._run = None
        del self.sequences[seq.rid]

    def receive(self, seq: Sequence, computed: int, now: float) -> int | None:
        """Run ``seq`` at once, its first ``computed`` tokens' KV sent by another engine: how many
        of its leading blocks this engine's prefix cache held (their KV need not be written), or
        None (nothing changed) when it has no seat or its blocks do not fit now."""
        if seq.rid in self.sequences:
            raise ValueError(f"rid {seq.rid}: already in the engine")
        if len(self.running) >= self.config.max_seqs:
            return None
        hits = self.blocks.lookup(seq)
        held = len(hits) * self.config.block_size
        if not self.blocks.admit(seq, hits, computed - held):
            return None
        self.blocks.computed(seq, computed - held)  # the blocks it fills are cached: kept here
        seq.status, seq.first_scheduled, seq.charged = SequenceStatus.RUNNING, now, len(seq.output_ids)
        self.sequences[seq.rid] = seq
        bisect.insort(self.running, seq, key=priority)
        self._run = None
        return len(hits)

    def decode_run(self) -> DecodeRun | None:
        """The run of decode steps the running sequences are in, or None if the next step is not
        a pure decode of all of them (see :mod:`workers.engine.decode_run`)."""
        running = self.running
        if self._run is not None or not running or (self.num_waiting and self._may_seat()):
            return self._run
        if len(running) <= self.config.max_batch_tokens and all(
            seq.output_ids and seq.remaining == 1 for seq in running  # its first token sampled
        ):
            length = min(map(self.tokens_left, running))
            stop_ids = frozenset().union(*map(self.stop_ids, running))
            self._run = DecodeRun(list(running), self.config.block_size, length, stop_ids)
        return self._run

    def schedule(self, now: float) -> Schedule:
        run = self.decode_run()
        if run is not None:
            growing = run.growing()
            if not growing or len(growing) <= self.blocks.num_free:  # else the step below preempts
                for seq in growing:
                    self.blocks.grow(seq, 1)
                return Schedule(run.seqs, run.ones, [], run)
        self._run = None
        budget, seqs, counts, preempted = self.config.max_batch_tokens, [], [], []
        if self.seats is not None:
            budget = self.seats.step_budget(self.running, budget, self.config.block_size)
        decodes = sum(1 for seq in self.running if seq.remaining == 1)
        bs, i = self.config.block_size, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.remaining
            decodes -= remaining == 1
            n = min(remaining, budget - decodes)
            if n > 0 and seq.num_computed + n > len(seq.block_table) * bs:  # else its blocks hold them
                while n > 0 and not self.blocks.grow(seq, n):
                    if self.running[-1] is not seq:
                        victim = self.running.pop()
                        decodes -= victim.remaining == 1
                        self.preempt(victim, now)
                        preempted.append(victim)
                    elif seq.remaining > 1 and self.blocks.room(seq) > 0:
                        n = min(n, self.blocks.room(seq))  # nobody left to preempt: a smaller chunk
                    elif i == 0:  # alone, and still no room: it can never finish
                        self.running.pop()
                        needed = cdiv(seq.num_computed + n, self.config.block_size)
                        self.finish(seq, FinishReason.TOO_LONG, now, self._too_long(needed))
                        n = 0
                    else:
                        self.running.pop()
                        self.preempt(seq, now)
                        preempted.append(seq)
                        n = 0
            if n > 0:
                seqs.append(seq)
                counts.append(n)
                budget -= n
            i += 1
        if not preempted:
            self._admit(budget, now, seqs, counts, preempted)
        return Schedule(seqs, counts, preempted)

    def _admit(self, budget: int, now: float, seqs: list[Sequence], counts: list[int],
               yielded: list[Sequence]) -> None:
        """Admit waiting sequences by tier, the preempted first, then by the tenants' shares,
        while budget, blocks and seats allow (a seat perhaps ``yielded``: the module doc)."""
        for tier in sorted(self.waiting):
            resumed, queue = self.resumed[tier], self.waiting[tier]
            if queue.tenants > 1:
                self._settle(tier)
            while budget > 0:
                seq = resumed[0] if resumed else queue.front()
                if seq is None:
                    break
                from_resumed = bool(resumed)
                while not self._has_seat(seq):
                    victim = who_yields(self.running, seq)
                    if victim is None:
                        return  # strict priority: nothing behind it jumps the queue
                    budget += self._unseat(victim, now, seqs, counts)
                    yielded.append(victim)
                hits = self.blocks.lookup(seq)
                uncached = seq.num_tokens - len(hits) * self.config.block_size
                n = min(uncached, budget)
                if not self.blocks.admit(seq, hits, n):
                    return  # strict priority: nothing behind it jumps the queue
                if from_resumed:
                    resumed.popleft()
                else:
                    queue.pop(charge=uncached)
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
                bisect.insort(self.running, seq, key=priority)
                if self.seats is not None:
                    self.seats.sit(seq)
                seqs.append(seq)
                counts.append(n)
                budget -= n

    def _has_seat(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run beside the running sequences: ``max_seqs``, and its target."""
        seats = self.seats
        return len(self.running) < self.config.max_seqs and (seats is None or seats.fits(seq))

    def _may_seat(self) -> bool:
        """Whether the front of some tier's waiting could take a seat now, or have one yielded."""
        for tier, queue in self.waiting.items():
            if queue.tenants > 1:
                self._settle(tier)  # the shares as they stand now decide which front it is
            front = self.resumed[tier][0] if self.resumed[tier] else queue.front()
            if front is not None and (self._has_seat(front) or who_yields(self.running, front)):
                return True
        return False

    def _unseat(self, victim: Sequence, now: float, seqs: list[Sequence], counts: list[int]) -> int:
        """Preempt running ``victim`` for a seat: out of this step (its tokens' budget returned,
        the count), back among its tenant's waiting (its turn by the shares, not before them)."""
        self.running.remove(victim)
        refund = 0
        if victim in seqs:
            at = seqs.index(victim)
            refund = counts[at]
            del seqs[at], counts[at]
        self._release(victim, now)
        self._queue(victim.tier).push(victim)
        return refund

    def preempt(self, seq: Sequence, now: float) -> None:
        """Send a running ``seq`` (already out of ``running``) back to the head of its tier."""
        self._release(seq, now)
        self.resumed[seq.tier].appendleft(seq)

    def _release(self, seq: Sequence, now: float) -> None:
        """A running ``seq``, out of ``running``, gives back its blocks and seat: it waits again."""
        if self.seats is not None:
            self.seats.leave(seq)
        self.blocks.free_blocks(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.preemptions.append(now)
        self.preemptions += 1
        self._run = None

    def _settle(self, tier: int) -> None:
        """Charge the tenants of ``tier`` for the answer tokens made since last charged."""
        queue = self.waiting[tier]
        for seq in self.running:
            made = len(seq.output_ids) - seq.charged
            if made and seq.tier == tier:
                queue.charge(seq.tenant, made)
                seq.charged += made

    def postprocess(self, schedule: Schedule, tokens: list[int | None], now: float) -> dict[int, int]:
        """Record what the step computed and sampled; returns each sequence's new token by rid."""
        if schedule.run is not None:
            # a decode run samples a token for every sequence, so no entry is None
            return self._decoded(schedule.run, tokens, now)  # type: ignore[arg-type]
        new: dict[int, int] = {}
        ended = False
        for seq, n, token in zip(schedule.seqs, schedule.num_tokens, tokens, strict=True):
            self.blocks.computed(seq, n)
            if seq.remaining:
                continue  # a prompt chunk short of the last token: nothing sampled
            assert token is not None, f"the runner sampled nothing for sequence {seq.rid}"
            seq.output_ids.append(token)
            new[seq.rid] = token
            if seq.first_token is None:
                seq.first_token = now
            reason = self.stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
                ended = True
        if ended:
            self.running = [seq for seq in self.running if not seq.finished]
        return new

    def _decoded(self, run: DecodeRun, tokens: list[int], now: float) -> dict[int, int]:
        """:meth:`postprocess` of a pure decode step: one token for each of the run's sequences."""
        for seq, token in zip(run.seqs, tokens, strict=True):
            seq.num_computed += 1
            seq.output_ids.append(token)
        for seq in run.growing(1):  # the token filled its block (the next step needs a new one)
            self.blocks.filled(seq)
        run.step += 1
        run.context += len(run.seqs)
        if run.ends(tokens):
            for seq in run.seqs:
                reason = self.stop_reason(seq, seq.output_ids[-1])
                if reason is not None:
                    self.finish(seq, reason, now)
            if self._run is None:  # a sequence ended
                self.running = [seq for seq in self.running if not seq.finished]
        return dict(zip(run.rids, tokens, strict=True))

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why ``seq`` ends with ``token`` just appended, or None if it goes on."""
        reason = self.token_stop(seq, token)
        if reason is not None:
            return reason
        return FinishReason.MAX_TOKENS if self.tokens_left(seq) <= 0 else None

    def tokens_left(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` may make before its length ends it: its ``max_tokens``,
        or the model's context, whichever is nearer."""
        left = seq.sampling.max_tokens - len(seq.output_ids)
        if self.max_model_len is not None and self.max_model_len - seq.num_tokens < left:
            return self.max_model_len - seq.num_tokens
        return left

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        """The ids that end ``seq`` when sampled (:meth:`token_stop`)."""
        sampling = seq.sampling
        eos = frozenset() if sampling.ignore_eos else self.eos_token_ids
        return eos.union(sampling.stop_token_ids) if sampling.stop_token_ids else eos

    def token_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        """Whether ``token`` itself ends ``seq``: an end-of-sequence id, or one of its stop ids."""
        if token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return FinishReason.EOS
        if token in seq.sampling.stop_token_ids:
            return FinishReason.STOP_TOKEN
        return None

    def finish(self, seq: Sequence, reason: FinishReason, now: float, detail: str = "") -> None:
        """Mark ``seq`` finished and free its blocks; the caller takes it out of its queue."""
        if self.seats is not None and seq.status is SequenceStatus.RUNNING:
            self.seats.leave(seq)
        self.blocks.free_blocks(seq)
        self._run = None
        self._charge(seq)
        seq.status, seq.finish_reason, seq.finished_at = SequenceStatus.FINISHED, reason, now
        del self.sequences[seq.rid]
        self.finished.append(seq)
        if detail:
            self.details[seq.rid] = detail

    def _charge(self, seq: Sequence) -> None:
        """Charge ``seq``'s tenant's share for the tokens it made and was not charged for yet."""
        made = len(seq.output_ids) - seq.charged
        if made:
            self._queue(seq.tier).charge(seq.tenant, made)
            seq.charged += made

    def _too_long(self, blocks: int) -> str:
        return (
            f"needs {blocks} blocks of {self.config.block_size} tokens alone; "
            f"the KV cache holds {self.config.num_blocks}"
        )
