"""A continuous model's pool for long prompts: which replica slots are long, which prompts go
there, and each slot's step budget. Pure.

A model with ``long_prompt_tokens = N`` and ``long_workers = K`` has its ordinary slots first
(``workers``, or the scaler's ``max_workers + warm_workers``), then K long slots of their own,
whose engines run the long table (:meth:`ContinuousModelConfig.long_table`: their own KV cache
and step budget; every prompt is chunked by the step budget)::

    prompt longer than N?  yes: the long lane    no: the ordinary lane
    long lane:     the long replicas, always (with none up, the job waits for one to restart)
    ordinary lane: the ordinary replicas taking work, if one of them is up
                   else the long replicas that are up (every ordinary engine died and restarts),
                        unless the scaler took the ordinary pool to zero (it starts one)
                   else the ordinary ones (the job waits, as in a pool with none up)

Never the other way: long prompts moved onto the ordinary replicas while the long ones restart
would stall every ordinary request behind their prefills, which the pool is there to prevent
(measured: a long engine killed mid-flood, its prompts on the ordinary replica, chat TTFT p50
from 145 ms to 5.7 s; experiments/docs/continuous-long-prompts.md). An ordinary prompt costs a
long replica little. So an ordinary prompt never lands on a long replica while an ordinary one
is up, a long prompt never on an ordinary replica, and the
estimates (queued tokens, rate, room) are each lane's own: a long prompt's wait is the long
pool's queue, an ordinary one's the ordinary pool's. The scaler moves the ordinary slots only;
the long ones are fixed. Why and when to choose it: docs/continuous.md, "A pool for long prompts".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from batcher.core.staffing import Staffing

if TYPE_CHECKING:
    from batcher.continuous.config import ContinuousModelConfig

W = TypeVar("W")


@dataclasses.dataclass(frozen=True, slots=True)
class Lanes:
    """The ordinary slots ``0..ordinary-1`` and the long ones after them (see the module doc)."""

    ordinary: int
    long: int = 0
    threshold: int = 0  # prompts longer than this are long (0 with no long slot)
    step_tokens: tuple[int, int] = (1, 1)  # max_batch_tokens of an ordinary and of a long replica
    decode: int = 0  # the last ordinary slots decode what prefill replicas hand them: no new work

    @property
    def long_slots(self) -> range:
        return range(self.ordinary, self.ordinary + self.long)

    def is_long(self, slot: int) -> bool:
        return slot >= self.ordinary

    def long_prompt(self, prompt_tokens: int) -> bool:
        """Whether a prompt of ``prompt_tokens`` goes to the long lane."""
        return bool(self.long) and prompt_tokens > self.threshold

    def members(self, long: bool) -> range:
        """The slots new work of a lane is routed to (a decode replica takes only hand-offs)."""
        return self.long_slots if long else range(self.ordinary - self.decode)

    def budget(self, slot: int) -> int:
        """The token budget of one step of ``slot``'s engine."""
        return self.step_tokens[self.is_long(slot)]

    def candidates(self, long: bool, staffing: Staffing, up: Sequence[bool]) -> set[int]:
        """The slots a job of the ``long`` lane may be routed to (see the module doc), where
        ``up[i]`` says whether slot ``i``'s engine is up and ``staffing`` which ordinary slots
        take work (only a stopped one, the next the scaler starts, when it scaled to zero)."""
        taking = staffing.taking() & set(self.members(False))
        if long:
            return set(self.long_slots)
        if any(up[i] for i in taking) or taking <= staffing.stopped:
            return taking
        return {i for i in self.long_slots if up[i]} or taking


def split_spawn(lanes: Lanes, ordinary: Callable[[int], W], long: Callable[[int], W]) -> Callable[[int], W]:
    """One spawn for every slot: the long slots' engines from ``long``, the others' from
    ``ordinary`` (each given the slot's own index, so each has its own device)."""

    def spawn(slot: int) -> W:
        return long(slot) if lanes.is_long(slot) else ordinary(slot)

    return spawn


def lanes_of(config: ContinuousModelConfig) -> Lanes:
    """The lanes of ``config``'s pool: its scaler's slots (or ``workers``), then its long ones."""
    ordinary = config.pool_config().workers
    if not config.long_workers:
        return Lanes(ordinary, step_tokens=(config.max_batch_tokens, config.max_batch_tokens),
                     decode=config.decode_workers)
    budgets = (config.max_batch_tokens, config.long_table().max_batch_tokens)
    return Lanes(ordinary, config.long_workers, config.long_prompt_tokens, budgets)
