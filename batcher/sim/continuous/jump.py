"""Runs of identical decode steps: planned without touching the engine, committed once the
engine's loop knows how many of them it took.

Between events a replica whose batch is pure decode (nobody waiting, every running sequence has
its first token and one token left to compute, the step budget covers them all) repeats the same
step: one token for each sequence, a context one longer. :meth:`Leap.plan` lays such a run out
at once, changing nothing: each step's price from the cost model and its end time, added up step
by step as the worker's loop would; the blocks each step allocates (a sequence needs a new one
every ``block_size`` steps, at a phase its block table fixes); and where the run must stop: after
the step that ends a sequence by its length (or by a token, where a token can end it: those runs
draw their tokens while planning), after the step that crosses the next ``stats`` frame, before a
step whose blocks would not fit (that step preempts: the real scheduler decides it).

:meth:`Leap.take` commits the first k planned steps with the real block manager doing exactly
what k calls of ``Engine.step`` would make it do, in the same order (each step's ``grow`` for
every sequence in priority order, then its ``computed``, which caches the blocks that filled),
each token from the simulated runner's own hash. The engine's loop
(:mod:`batcher.sim.continuous.engine`) takes every planned step when the run reaches its end, or,
when something reaches the engine first (work from the pool, a look at its blocks), the steps
ended by then and the one under way: a step-by-step engine has already started that one, and
takes the new work at the step after it.
"""

from __future__ import annotations

import math

from workers.engine.engine import Engine, SequenceEnd
from workers.engine.sequence import Sequence
from workers.engine.simulated import SimulatedRunner


def _decode_batch(engine: Engine) -> bool:
    """Whether nothing but the running sequences' decodes can be in the next step: nobody
    waiting or just finished, a budget that covers one token for each (the module doc)."""
    scheduler = engine.scheduler
    running = scheduler.running
    if not running or scheduler.num_waiting or scheduler.finished:
        return False
    return len(running) <= engine.config.max_batch_tokens


class Leap:
    """A planned run of pure decode steps (see the module doc): ``ends[i]`` is when step i+1
    ends; after :meth:`take`, ``ids[j]`` holds the tokens ``seqs[j]`` made, ``ended`` the
    sequences the last step ended."""

    def __init__(self, engine: Engine, runner: SimulatedRunner, start: float) -> None:
        self.engine, self.runner, self.start = engine, runner, start
        self.seqs = list(engine.scheduler.running)
        self.ends: list[float] = []
        self.seconds: list[float] = []
        self.ids: list[list[int]] = [[] for _ in self.seqs]
        self.ended: list[SequenceEnd] = []
        self._groups: list[list[Sequence]] = []  # by step % block_size: who needs a new block
        self._last = math.inf  # the step (from 1) at which a sequence reaches its length
        self._enders: list[Sequence] = []  # the sequences that reach it then
        self._drawn: list[list[int]] | None = None  # each step's tokens, drawn while planning

    @property
    def end(self) -> float:
        return self.ends[-1]

    @classmethod
    def plan(cls, engine: Engine, runner: SimulatedRunner, start: float, stats_at: float) -> Leap | None:
        """The run of pure decode steps from ``start``, or None if the next step is not a pure
        decode whose blocks fit (``Engine.step`` takes it)."""
        if not _decode_batch(engine):
            return None
        run = cls(engine, runner, start)
        scheduler, bs = engine.scheduler, engine.config.block_size
        groups: list[list[Sequence]] = [[] for _ in range(bs)]
        context, can_end, model_len, eos = 0, False, scheduler.max_model_len, runner.eos_prob > 0
        for seq in run.seqs:
            outputs, computed = seq.output_ids, seq.num_computed
            if not outputs or computed != len(seq.prompt_ids) + len(outputs) - 1:
                return None  # a prompt still to compute, or a first token still to sample
            phase = len(seq.block_table) * bs - computed  # steps its blocks still cover
            assert 0 <= phase < bs, f"sequence {seq.rid}: block table not one block ahead of its KV"
            groups[phase].append(seq)
            length = seq.sampling.max_tokens - len(outputs)
            if model_len is not None:
                length = min(length, model_len - computed - 1)
            if length < run._last:
                run._last, run._enders = length, [seq]
            elif length == run._last:
                run._enders.append(seq)
            context += computed + 1
            if not can_end:  # a token can end it: an end-of-sequence the runner may draw, a stop id
                sampling = seq.sampling
                can_end = bool(sampling.stop_token_ids) or (eos and not sampling.ignore_eos)
        run._groups = groups
        if can_end:
            run._drawn = []
            lasts = [seq.output_ids[-1] for seq in run.seqs]
        n, cost, free, now = len(run.seqs), runner.cost, scheduler.blocks.num_free, start
        while True:
            step = len(run.ends)
            need = len(groups[step % bs])
            if need > free:
                break
            free -= need
            seconds = cost.decode_seconds(n, context)
            now += seconds
            context += n
            run.seconds.append(seconds)
            run.ends.append(now)
            if run._drawn is not None:
                lasts = [
                    runner.token(seq.sampling.seed, len(seq.output_ids) + step, last, seq.num_computed + step)
                    for seq, last in zip(run.seqs, lasts, strict=True)
                ]
                run._drawn.append(lasts)
                if any(scheduler.token_stop(seq, t) for seq, t in zip(run.seqs, lasts, strict=True)):
                    break
            if step + 1 == run._last or now >= stats_at:
                break
        return run if run.ends else None

    def take(self, steps: int) -> None:
        """Commit the first ``steps`` planned steps to the engine (the run ends after them)."""
        engine, runner = self.engine, self.runner
        scheduler = engine.scheduler
        blocks, bs = scheduler.blocks, engine.config.block_size
        seqs, groups, drawn = self.seqs, self._groups, self._drawn
        seeds = [seq.sampling.seed for seq in seqs]
        n = len(seqs)
        begin = self.start
        draw, rows = runner.token, list(zip(seqs, seeds, self.ids, strict=True))
        for step in range(steps):
            for seq in groups[step % bs]:
                blocks.grow(seq, 1)
            if drawn is None:
                tokens = [draw(seed, len(seq.output_ids), seq.output_ids[-1], seq.num_computed)
                          for seq, seed, _ in rows]
            else:
                tokens = drawn[step]
            for (seq, _, ids), token in zip(rows, tokens, strict=True):
                computed = seq.num_computed
                if (computed + 1) % bs:
                    seq.num_computed = computed + 1  # what blocks.computed does when no block fills
                else:
                    blocks.computed(seq, 1)
                seq.output_ids.append(token)
                ids.append(token)
            # who can end at this step: anyone where a token can end it, else those at their length
            ending = seqs if drawn is not None else self._enders if step + 1 == self._last else ()
            for seq in ending:
                reason = scheduler.stop_reason(seq, seq.output_ids[-1])
                if reason is not None:
                    scheduler.finish(seq, reason, begin)
            seconds = self.seconds[step]
            runner.last_step_seconds = seconds
            runner.total_seconds += seconds
            engine.steps += 1
            engine.computed_tokens += n
            engine.generated_tokens += n
            begin = self.ends[step]
        del self.ends[steps:]
        if scheduler.finished:
            scheduler.running = [seq for seq in scheduler.running if not seq.finished]
            self.ended = engine.take_finished()
