"""Many identical decode steps at once: the engine's state as k single steps leave it, in one go.

Between events a replica whose batch is pure decode (nobody waiting, every running sequence has
its first token and one token left to compute, the step budget covers them all) repeats the same
step: one token for each sequence, a context one longer. A :class:`Leap` advances k such steps with
the real block manager doing exactly what k calls of ``Engine.step`` would make it do, in the
same order (each step's ``grow`` for every sequence in priority order, then its ``computed``,
which caches the blocks that filled), each token from the simulated runner's own hash, each step
priced by the cost model and the virtual times added up step by step as the worker's loop would.

It stops after the step that ends a sequence, after the step that crosses the next ``stats``
frame, before a step whose blocks would not fit (that step preempts: the real scheduler decides
it), and before a step that would end after ``horizon``: the next time anything outside the
engine looks at it or sends it work (an arrival at the router, a KV sample). Whatever is not pure
decode is left to ``Engine.step``. The first step is taken at once, as ``Engine.step`` would
take it; the rest only once every task has reacted to what happened at that instant (the frames
just handed out may have sent it work: then it stops at one step, as the worker's loop would
have taken that work at the next). Its frames are the k steps' frames merged: one ``tokens``
frame of k ids a sequence, then the ``finished`` frames of the last step.
"""

from __future__ import annotations

import math

from workers.engine.block_manager import cdiv
from workers.engine.engine import Engine, SequenceEnd
from workers.engine.serve import STOPS
from workers.engine.simulated import SimulatedRunner
from workers.protocol import Message, SequenceFinished, Tokens, Usage


def pure_decode(engine: Engine) -> bool:
    """Whether the next step is a pure decode that a :class:`Leap` can take (the module doc)."""
    scheduler = engine.scheduler
    running = scheduler.running
    if not running or scheduler.num_waiting or scheduler.finished:
        return False
    if len(running) > engine.config.max_batch_tokens:
        return False
    return all(seq.output_ids and seq.num_computed == seq.num_tokens - 1 for seq in running)


def _new_blocks(engine: Engine) -> int:
    """The blocks the next decode step allocates (a sequence whose last block is full)."""
    bs = engine.config.block_size
    return sum(cdiv(s.num_computed + 1, bs) - len(s.block_table) for s in engine.scheduler.running)


class Leap:
    """A run of pure decode steps from ``start``: each :meth:`advance` takes more of them; the
    run's end and its frames merged once it is over (see the module doc)."""

    def __init__(self, engine: Engine, runner: SimulatedRunner, start: float, stats_at: float) -> None:
        self.engine, self.runner, self.stats_at = engine, runner, stats_at
        self.end = start
        self.steps = 0
        self.over = False
        self._ids: dict[int, list[int]] = {seq.rid: [] for seq in engine.scheduler.running}
        self._ended: list[SequenceEnd] = []

    @classmethod
    def first(cls, engine: Engine, runner: SimulatedRunner, start: float, stats_at: float) -> Leap | None:
        """The run's first step taken, or None if the next step is not a pure decode whose
        blocks fit (``Engine.step`` takes it)."""
        if not pure_decode(engine) or _new_blocks(engine) > engine.scheduler.blocks.num_free:
            return None
        run = cls(engine, runner, start, stats_at)
        run.advance(math.inf, 1)
        return run

    def advance(self, horizon: float, most: int | None = None) -> None:
        """Take the next steps (``most`` at most) that end by ``horizon``, while nothing ends the run."""
        engine, runner = self.engine, self.runner
        scheduler, cost = engine.scheduler, runner.cost
        blocks, running = scheduler.blocks, list(scheduler.running)
        n, now = len(running), self.end
        context = sum(seq.num_computed + 1 for seq in running)
        ids, last = self._ids, math.inf if most is None else self.steps + most
        bs, need = engine.config.block_size, _new_blocks(engine)
        while not self.over and self.steps < last:
            seconds = cost.decode_seconds(n, context)
            if now + seconds > horizon or need > blocks.num_free:
                break
            for seq in running:
                if len(seq.block_table) * bs <= seq.num_computed:  # its last block is full
                    blocks.grow(seq, 1)
            need = 0
            for seq in running:
                outputs, computed = seq.output_ids, seq.num_computed
                token = runner.token(seq.sampling.seed, len(outputs), outputs[-1], computed)
                if (computed + 1) % bs:
                    seq.num_computed = computed + 1  # what blocks.computed does when no block fills
                else:
                    blocks.computed(seq, 1)
                outputs.append(token)
                ids[seq.rid].append(token)
                reason = scheduler._stop_reason(seq, token)
                if reason is not None:
                    scheduler._finish(seq, reason, now)
                elif len(seq.block_table) * bs <= computed + 1:
                    need += 1
            runner.last_step_seconds = seconds
            runner.total_seconds += seconds
            engine.steps += 1
            engine.computed_tokens += n
            engine.generated_tokens += n
            self.steps += 1
            now += seconds
            context += n
            if scheduler.finished:
                scheduler.running = [seq for seq in scheduler.running if not seq.finished]
                self._ended = [engine._finished(seq) for seq in scheduler.finished]
                scheduler.finished = []
                self.over = True
            self.over |= now >= self.stats_at
        self.end = now

    def frames(self) -> list[Message]:
        return _frames(self._ids, self._ended)


def _frames(ids: dict[int, list[int]], ended: list[SequenceEnd]) -> list[Message]:
    stopped = {done.rid for done in ended if done.reason in STOPS}
    frames: list[Message] = []
    for rid, tokens in ids.items():
        sent = tokens[:-1] if rid in stopped else tokens  # a stop token is not text
        if sent:
            frames.append(Tokens(rid=rid, ids=sent))
    for done in ended:
        usage = Usage(done.prompt_tokens, done.cached_tokens, done.output_tokens)
        frames.append(SequenceFinished(rid=done.rid, reason=done.reason.value, usage=usage))
    return frames
