"""The serving loop of every engine, without I/O: frames in, a step when there is work, frames out.

Each turn takes the ``add`` and ``abort`` frames that have arrived, runs one step while the
engine has work, and hands out that step's frames (:func:`step_messages`) and, once
:data:`STATS_INTERVAL` has passed, ``stats``; while idle it waits for a frame or the next
``stats``. A step that should delay the next ``stats`` is announced as it starts (a ``step``
frame, from the shell's :class:`~workers.engine.interface.StepWatch`), so that the pool does not
take the silence for a hang. Two shells drive it: the worker process
(``workers/engine/serve.py``: the pipe and the wall clock) and the simulated engine of
``batcher.sim`` (trio's virtual clock, whose steps cannot hang and are not announced).

An engine that takes part in prefill -> decode hand-offs has a :class:`Handoffs`
(:mod:`workers.engine.kv_transfer`): it takes the hand-off frames, and after each step says
which sequences left the engine, whose frames follow that step's.

A frame the loop cannot take breaks the protocol (:class:`~workers.protocol.ProtocolError`): a
kind an engine does not take, an ``add`` the engine refuses (a rid already live, sampling out of
range, an empty prompt). An ``abort`` of a rid the engine does not hold (it has just finished)
is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from workers.engine.interface import EngineCore, SequenceEnd, StepOutput, StepWatch
from workers.engine.sequence import FinishReason
from workers.protocol import (
    Abort,
    Add,
    EngineStats,
    Message,
    ProtocolError,
    SequenceFinished,
    StepBegun,
    Tokens,
)

STATS_INTERVAL = 0.2
HANDOFF_READ_WAIT = 0.05
"""How long the engine waits for the next bytes of a hand-off midway before it steps anyway:
the pool writes a hand-off in one go, so its rest is on its way unless the pool stalls."""
STOPS = (FinishReason.EOS, FinishReason.STOP_TOKEN)  # ended by a stop token: its id is not sent


class Handoffs(Protocol):
    """An engine's side of the KV hand-off (:class:`workers.engine.kv_transfer.KvTransfer`)."""

    def take(self, message: Message) -> bool:
        """Take a hand-off's frame; False if ``message`` is not one."""

    def exports(self, output: StepOutput) -> list[Message]:
        """After the step that made ``output``: the frames of the hand-offs taken before it, and
        of the sequences that leave the engine."""

    @property
    def arriving(self) -> bool:
        """A hand-off's ``kv`` frames have come without their ``kv_handoff`` yet."""


class EngineLoop:
    """One engine's loop (see the module doc); ``now`` is when it starts, its first ``stats`` due.
    ``watch`` sees every step begin and end (a worker process's forecast of long steps)."""

    def __init__(self, engine: EngineCore, now: float, handoffs: Handoffs | None = None,
                 watch: StepWatch | None = None) -> None:
        self.engine, self.handoffs, self.watch = engine, handoffs, watch
        self.next_stats = now

    def take(self, messages: Iterable[Message]) -> None:
        """The frames that have arrived, in order, before the next step."""
        for message in messages:
            if isinstance(message, Abort):
                self.engine.abort(message.rid)
                continue
            if self.handoffs is not None and self.handoffs.take(message):
                continue
            if not isinstance(message, Add):
                raise ProtocolError(f"unexpected {message.kind} frame")
            try:
                self.engine.add(
                    message.prompt_tokens, message.sampling, tier=message.tier, tenant=message.tenant,
                    rid=message.rid, weight=message.weight, output_ids=message.output_tokens,
                    tpot_target=message.tpot_target,
                )
            except ValueError as exc:
                raise ProtocolError(f"add {message.rid} refused: {exc}") from None

    def read_wait(self, now: float, pending: int, more: bool = False) -> float:
        """How long the next read of frames may wait, in seconds, with ``pending`` bytes of a
        frame part-read (``more``: after a read in this turn). A hand-off midway:
        :data:`HANDOFF_READ_WAIT`, so that its rest is read before the next step rather than a
        pipe's worth a step. Else none while the engine has work (or after a read: what has
        arrived is taken, then the step runs), and until the next ``stats`` while it is idle."""
        if pending or (self.handoffs is not None and self.handoffs.arriving):
            return HANDOFF_READ_WAIT
        if more or self.engine.has_work:
            return 0.0
        return max(0.0, self.next_stats - now)

    def step(self) -> StepOutput | None:
        """One step, or None while the engine has no work (the loop waits for a frame or stats)."""
        return self.engine.step(self.watch) if self.engine.has_work else None

    def announce(self, seconds: float) -> StepBegun:
        """The ``step`` frame of a step starting that should take ``seconds``. The step's end is
        reported with ``stats`` at once, whenever the last were sent, so that the pool's limit is
        the stats timeout again as soon as the step is over."""
        self.next_stats = -math.inf
        return StepBegun(seconds=seconds)

    def stats(self, now: float) -> EngineStats | None:
        """The ``stats`` frame, if one is due at ``now``."""
        if now < self.next_stats:
            return None
        self.next_stats = now + STATS_INTERVAL
        return self.engine.stats()


def step_messages(output: StepOutput) -> list[Tokens | SequenceFinished]:
    """A step's frames: every new token, then every sequence that ended (its last token first).

    A stop token (end-of-sequence, or one of the request's stop ids) is not sent: it is not text,
    and ``finished`` counts it in the usage. Leaving it out here, where the step is known, keeps
    the pool from having to tell a stop id from text by where a frame falls in what it read.
    """
    stopped = {done.rid for done in output.finished if done.reason in STOPS}
    messages: list[Tokens | SequenceFinished] = [
        Tokens(rid=rid, ids=[token]) for rid, token in output.tokens.items() if rid not in stopped
    ]
    messages += map(finished_message, output.finished)
    return messages


def finished_message(done: SequenceEnd) -> SequenceFinished:
    """The ``finished`` frame of a sequence that ended, with its usage."""
    return SequenceFinished(rid=done.rid, reason=done.reason.value, usage=done.usage)
