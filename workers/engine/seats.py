"""Seats under a time-per-output-token promise, and who yields one. Pure.

A tier may promise a time per output token (``tpot_target_ms``); each sequence carries its
tier's target, in seconds (0: none). Every running sequence decodes in every step, so a step's
time is the TPOT of every sequence in it: the strictest target among the running sequences bounds
the whole step, whatever the others' tiers. The engine's step-cost model (the one ``ferry fit``
fits on this machine, or a simulated engine's own prices) prices a decode step of ``n`` sequences
over ``c`` context tokens; a sequence takes a seat only if the decode step of the running ones and
it, each at its *longest* context (prompt and ``max_tokens``, within the model's), is priced
within the strictest target among them all::

    seats(R + s)  iff  R is empty  or  decode_seconds(|R| + 1, sum longest(R + s)) <= min target(R + s)

Longest contexts make the bound hold for the sequences' whole lives: a seat given is never taken
back because a context grew. One sequence alone always runs (no step can be shorter). A prompt
chunk beside promised decodes is cut to what keeps the step within the target, but never below
a block's worth of tokens, so a prefill slows the decodes by that much at most and never stalls.

**Who yields.** A waiting sequence that finds no seat (the target's, or ``max_seqs``) may take one
from a running sequence, preempted by recompute (its full blocks stay cached, so its return is
mostly prefix hits): first the newest of a lower tier than its own; else, in its own tier, the
newest of the tenant furthest over its share of the tier's seats, if moving the seat makes the
shares more even::

    yield from v to t  iff  (seats[v] - 1) / weight[v]  >=  (seats[t] + 1) / weight[t]

so the reverse move is never also allowed (no two tenants trade a seat back and forth), and a
tenant alone in its tier never preempts itself. This is what keeps a light tenant's first token
a lone step away while a heavy one holds every seat: fair shares choose whose sequence waits.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.engine.cost_model import CostModel
from workers.engine.sequence import Sequence


def longest_context(seq: Sequence, max_model_len: int | None) -> int:
    """The most tokens ``seq`` can hold: its prompt and every token it may make, or the model's context."""
    longest = seq.num_prompt + seq.sampling.max_tokens
    return longest if max_model_len is None else min(longest, max_model_len)


class Seats:
    """The seat rule of the module doc over ``cost``, for sequences running in one engine.

    It keeps the sum of the running sequences' longest contexts and their targets' counts, so a
    question costs one price of the cost model, whatever the number running."""

    def __init__(self, cost: CostModel, max_model_len: int | None = None) -> None:
        self.cost, self.max_model_len = cost, max_model_len
        self.seats = 0
        self.context = 0  # the running sequences' longest contexts, summed
        self._targets: dict[float, int] = {}  # target seconds -> running sequences holding it

    def target(self, extra: Sequence | None = None) -> float:
        """The strictest target among the running sequences (and ``extra``); 0: none."""
        targets = [t for t in self._targets if t > 0]
        if extra is not None and extra.tpot_target > 0:
            targets.append(extra.tpot_target)
        return min(targets, default=0.0)

    def fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may take a seat beside the running sequences (module doc)."""
        if not self.seats:
            return True
        target = self.target(seq)
        if target <= 0:
            return True
        context = self.context + longest_context(seq, self.max_model_len)
        return self.cost.decode_seconds(self.seats + 1, context) <= target

    def step_budget(self, running: Iterable[Sequence], budget: int, floor: int) -> int:
        """The tokens a step may compute so that the running decodes' step, with one prompt chunk
        of the rest, is priced within the running sequences' strictest target (the chunk priced
        at the context of the first running prefill, else as a fresh prompt's), between the
        decodes and ``floor`` more and ``budget``: a prefill beside promised decodes advances in
        smaller chunks rather than stall them, and never stops."""
        target = self.target()
        contexts, start = [], 0
        for seq in running:
            if seq.remaining == 1:
                contexts.append(seq.num_computed + 1)
            elif not start:
                start = seq.num_computed
        if target <= 0 or not contexts:
            return budget
        decodes, ones = len(contexts), [1] * len(contexts)

        def within(tokens: int) -> bool:
            chunk = tokens - decodes
            return self.cost.step([*ones, chunk], [*contexts, start + chunk]).seconds <= target

        if within(budget):
            return budget
        low, high = min(budget, decodes + floor), budget  # low: always allowed
        while low < high:
            middle = (low + high + 1) // 2
            if within(middle):
                low = middle
            else:
                high = middle - 1
        return low

    def step_seconds(self) -> float:
        """The price of a decode step of the running sequences at their longest contexts."""
        return self.cost.decode_seconds(self.seats, self.context) if self.seats else 0.0

    def sit(self, seq: Sequence) -> None:
        self.seats += 1
        self.context += longest_context(seq, self.max_model_len)
        self._targets[seq.tpot_target] = self._targets.get(seq.tpot_target, 0) + 1

    def leave(self, seq: Sequence) -> None:
        self.seats -= 1
        self.context -= longest_context(seq, self.max_model_len)
        left = self._targets[seq.tpot_target] - 1
        if left:
            self._targets[seq.tpot_target] = left
        else:
            del self._targets[seq.tpot_target]


def who_yields(running: Iterable[Sequence], seq: Sequence) -> Sequence | None:
    """The running sequence that gives ``seq`` its seat (module doc, "Who yields"), or None.

    ``running`` in priority order (tier, then arrival): the last of a lower tier is the newest of
    the lowest. O(len(running))."""
    seats: dict[str, int] = {}
    newest: dict[str, Sequence] = {}
    weights: dict[str, float] = {}
    lower: Sequence | None = None
    for other in running:
        if other.tier > seq.tier:
            lower = other
        elif other.tier == seq.tier:
            seats[other.tenant] = seats.get(other.tenant, 0) + 1
            newest[other.tenant], weights[other.tenant] = other, other.weight
    if lower is not None:
        return lower
    mine = (seats.get(seq.tenant, 0) + 1) / seq.weight
    best, most = None, mine
    for tenant, count in seats.items():
        if tenant != seq.tenant and (count - 1) / weights[tenant] >= most:
            best, most = tenant, (count - 1) / weights[tenant]
    return None if best is None else newest[best]
