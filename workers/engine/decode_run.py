"""A run of identical decode steps: the scheduler's pure-decode step, and the steps after it. Pure.

While nothing waits, every running sequence is one token from its next (its prompt computed,
its last token sampled) and the step's budget covers one token for each, every step is the
same: one token for each running sequence, in priority order, a context one longer. A
:class:`DecodeRun` holds what those steps need: which sequences need a new block at which step
(one every ``block_size`` steps, at a phase each one's block table fixes), the step at which the
first sequence reaches its length, and the ids that can end one sooner. The scheduler takes such
steps through it (:class:`~workers.engine.scheduler.Scheduler`), and a runner that prices steps
reads a step's context from it: how the next steps go is known before they are taken.
"""

from __future__ import annotations

from workers.engine.sequence import Sequence


class DecodeRun:
    """The decode steps of ``seqs`` (in priority order) from now: ``step`` counts those taken,
    ``length`` is the step (counted the same way) after which the first of them reaches its
    length, ``stop_ids`` the ids that end one when sampled, ``context`` the tokens the next step
    attends over, all sequences together."""

    def __init__(self, seqs: list[Sequence], block_size: int, length: int, stop_ids: frozenset[int]) -> None:
        self.seqs, self.block_size, self.length, self.stop_ids = seqs, block_size, length, stop_ids
        self.rids = [seq.rid for seq in seqs]
        self.ones = [1] * len(seqs)  # the step's tokens per sequence, as a Schedule lists them
        self.step = 0
        self.context = sum(seq.num_computed for seq in seqs) + len(seqs)
        self._growing: list[list[Sequence]] = [[] for _ in range(block_size)]  # by step % block_size
        for seq in seqs:
            self._growing[len(seq.block_table) * block_size - seq.num_computed].append(seq)

    def growing(self, ahead: int = 0) -> list[Sequence]:
        """The sequences that need a new block for the step ``ahead`` steps from now, in priority
        order: those whose blocks are full."""
        return self._growing[(self.step + ahead) % self.block_size]

    def ends(self, tokens: list[int]) -> bool:
        """Whether the step that sampled ``tokens`` (one per sequence) may end a sequence."""
        return self.step == self.length or not self.stop_ids.isdisjoint(tokens)
