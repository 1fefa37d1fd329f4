"""When a seat frees for a new sequence under a TPOT target: admission's second wait. Pure.

Under a tier's ``tpot_target_ms`` an engine seats a sequence only while a decode step of the
running ones and it, each at its longest context (prompt and ``max_tokens``), is priced within
the strictest target among them (``workers.engine.seats``). A request can then wait although
no prompt is queued ahead of it: every seat is held, and it starts when one frees. The token
backlog (:mod:`batcher.continuous.token_load`) does not see that wait; this module prices it,
from the same cost model (the ``step_costs`` file the engines read), for the replica a request
is routed to::

    fits now          iff  nothing runs, or decode(held + 1, context + longest) <= target
    takes a seat      iff  a lower tier holds one, or a tenant v of its own tier has
                           (seats[v] - 1) / weight[v] >= (seats[t] + 1) / weight[t]   (who yields)
    else seat wait    =    owed / decode rate

``owed`` is the tokens the held sequences still owe and ``decode rate`` the tokens per second
the engine makes for them (measured; until measured, one token per sequence per priced decode
step): the mean held sequence's remaining decode, which is when the first of a batch of long
requests started together frees its seat. A light tenant beside a heavy one that holds every
seat is not priced behind it: its share takes a seat at once, as the engine will give it.

A :class:`SeatBook` keeps one replica's held sequences as sums (count, contexts, owed tokens,
seats per tier and per tenant), so an estimate costs a look per tenant of the tier and one
priced step, never a pass over the sequences."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from batcher.continuous.token_load import TokenLoad

Price = Callable[[int, int], float]
"""Seconds of a decode step of ``seqs`` sequences over ``context_tokens`` (the engine's cost model)."""


class SeatBook:
    """The sequences one replica's engine holds (sent and not yet ended), summed."""

    __slots__ = ("context", "held", "owed", "tenants", "tiers")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """None held (its engine is gone)."""
        self.held = 0
        self.context = 0  # the held sequences' longest contexts, summed
        self.owed = 0  # the tokens they still owe
        self.tiers: dict[int, int] = {}  # tier -> sequences held
        self.tenants: dict[int, dict[str, int]] = {}  # tier -> tenant -> sequences held

    def sit(self, tier: int, tenant: str, longest: int, owed: int) -> None:
        self.held += 1
        self.context += longest
        self.owed += owed
        self.tiers[tier] = self.tiers.get(tier, 0) + 1
        tenants = self.tenants.setdefault(tier, {})
        tenants[tenant] = tenants.get(tenant, 0) + 1

    def leave(self, tier: int, tenant: str, longest: int, owed: int) -> None:
        self.held -= 1
        self.context -= longest
        self.owed -= owed
        self.tiers[tier] = left = self.tiers[tier] - 1
        if not left:
            del self.tiers[tier]
        tenants = self.tenants[tier]
        tenants[tenant] = left = tenants[tenant] - 1
        if not left:
            del tenants[tenant]
            if not tenants:
                del self.tenants[tier]


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """The new request as the seat rule sees it."""

    tier: int
    tenant: str
    weight: float
    longest: int  # its prompt and max_tokens, within the model's context


def preempts(book: SeatBook, new: Arrival, weights: Mapping[str, float]) -> bool:
    """Whether ``new`` takes a running sequence's seat (``workers.engine.seats.who_yields``):
    a lower tier holds one, or a tenant of its tier is further over its share than ``new``'s
    tenant would be with it. O(tenants of its tier)."""
    if any(tier > new.tier for tier in book.tiers):
        return True
    tenants = book.tenants.get(new.tier, {})
    mine = (tenants.get(new.tenant, 0) + 1) / new.weight
    return any(tenant != new.tenant and (count - 1) / weights.get(tenant, 1.0) >= mine
               for tenant, count in tenants.items())


def seat_wait(book: SeatBook, new: Arrival, targets: Sequence[float], max_seqs: int,
              price: Price, decode_rate: float, weights: Mapping[str, float]) -> float:
    """Seconds until ``new`` takes a seat on the replica ``book`` describes (the module doc);
    0 where no tier it would run beside promises a TPOT. ``targets``: seconds per tier (0:
    none); ``decode_rate``: tokens/s the engine makes for its sequences (0: not measured)."""
    if not book.held:
        return 0.0
    promised = [targets[tier] for tier in (*book.tiers, new.tier) if targets[tier] > 0]
    if not promised:
        return 0.0
    target = min(promised)
    fits = price(book.held + 1, book.context + new.longest) <= target
    if (fits and book.held < max_seqs) or preempts(book, new, weights):
        return 0.0
    rate = decode_rate if decode_rate > 0 else book.held / price(book.held, book.context)
    return book.owed / rate if rate > 0 else math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class SeatedLoad:
    """A :class:`~batcher.core.admission.Load`: ``tokens`` as a new job of ``tier`` sees it, whose
    own wait is the larger of the token backlog's and the seat wait (``seats`` seconds)."""

    tokens: TokenLoad
    tier: int
    seats: float

    @property
    def queued(self) -> tuple[float, ...]:
        return self.tokens.queued

    @property
    def measured(self) -> bool:
        return self.tokens.measured or self.seats > 0

    @property
    def drain_rate(self) -> float:
        return self.tokens.drain_rate

    def wait(self, tier: int, cost: float = 0.0) -> float:
        wait = self.tokens.wait(tier, cost)
        return max(wait, self.seats) if tier == self.tier else wait

    def pressure(self, tier: int) -> float:
        return self.tokens.pressure(tier)
