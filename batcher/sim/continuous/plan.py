"""When a simulated engine's next decode steps would end: a look ahead that changes nothing.

While the running sequences are in a run of decode steps (the scheduler's
:class:`~workers.engine.decode_run.DecodeRun`), a priced step's time is known before it is
taken, so the replay's engine (:mod:`batcher.sim.continuous.engine`) can wait for the end of
many steps at once. :func:`plan` lays them out from the run: each step's new blocks against
the free ones left, its price and end; and where the run stops: after the step at which a
sequence reaches its length, after one that draws an id that may end a sequence (drawn ahead
only where the runner can draw one), after the step that crosses ``until`` (the next stats),
and before a step whose blocks do not fit (it preempts: the scheduler decides that one).
"""

from __future__ import annotations

import dataclasses

from workers.engine.engine import Engine
from workers.engine.simulated import SimulatedRunner


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The run from ``start``: ``ends[i]`` is when its step ``i + 1`` would end; ``seqs`` are the
    tokens a step makes."""

    start: float
    ends: list[float]
    seqs: int


def plan(engine: Engine, runner: SimulatedRunner, start: float, until: float) -> Plan | None:
    """The run of decode steps from ``start``, or None if the next step is not one whose
    blocks fit, or an ended sequence is still to be reported (``Engine.step`` takes it)."""
    scheduler = engine.scheduler
    run = scheduler.decode_run()
    if run is None or scheduler.finished:
        return None
    seqs, cost = run.seqs, runner.cost
    stops = run.stop_ids if runner.eos_prob else run.stop_ids - runner.eos_token_ids  # ids it may draw
    lasts = [seq.output_ids[-1] for seq in seqs]
    free, n, context, now = scheduler.blocks.num_free, len(seqs), run.context, start
    ends: list[float] = []
    while True:
        step = len(ends)
        need = len(run.growing(step))
        if need > free:
            break
        free -= need
        now += cost.decode_seconds(n, context)
        context += n
        ends.append(now)
        if stops:
            lasts = [
                runner.token(seq.sampling.seed, len(seq.output_ids) + step, last, seq.num_computed + step)
                for seq, last in zip(seqs, lasts, strict=True)
            ]
            if not stops.isdisjoint(lasts):
                break
        if run.step + step + 1 == run.length or now >= until:
            break
    return Plan(start, ends, n) if ends else None
