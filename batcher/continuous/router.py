"""Which engine replica a new request goes to: least queued tokens, with bounded prefix affinity.

Pure: the engine pool passes each replica's load and the request's prefix in, and tells the
router what it sent where; nothing here reads a clock or does I/O.

**Load** is queued tokens: for every request a replica has been given and not finished, the
prompt tokens it still has to prefill plus the output tokens it may still generate (its
``max_tokens`` less what it has made), whether the request waits in the pool's queue for that
replica or already runs in its engine. Round robin would send work to a replica whose KV cache
is full while another is half empty; tokens, not requests, are what a step costs.

**Prefix** is the chain of hashes of the prompt's full blocks, computed as the engine's block
manager computes them (:func:`workers.prefix_hash.prefix_hashes`, the one chain both import:
salted by model version and tenant, so two tenants never share a key), up to the block
before the prompt's last token, which the engine always computes. For each replica the router
remembers the block hashes it has sent there, most recent last, at most as many as that
replica's KV cache holds blocks: a picture of what its prefix cache can still hold, which the
engine evicts in the same LRU order. A replica *holds* a request's first ``m`` blocks when the
first ``m`` hashes of its chain are all in its picture.

**The choice** (SGLang's cache-aware router and "consistent hashing with bounded loads", with
the bound in tokens)::

    least   = the smallest load among live replicas
    holders = live replicas holding >= 1 block of the prefix, whose load <= least + bound
    winner  = the holder with the longest held prefix (ties: less load, then lower index),
              else the least-loaded live replica (ties: lower index)

so a repeated system prompt keeps going to the replica that has it cached, until that replica
is ``bound`` tokens busier than the least busy one; then it spreads, and the new replica starts
holding the prefix too. A replica that dies loses its cache, and the router forgets its picture.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes, and how many of its leading blocks that replica already holds."""

    replica: int
    held_blocks: int


class Router:
    """Picks a replica for each request (see the module doc) and remembers what went where.

    ``capacity[i]`` is how many block hashes replica ``i``'s picture keeps: its KV cache in blocks.
    """

    def __init__(self, capacity: Sequence[int], bound: float) -> None:
        if bound < 0:
            raise ValueError(f"router bound: expected tokens >= 0, got {bound}")
        self.bound = bound
        self.capacity = list(capacity)
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.capacity]

    def held(self, replica: int, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` replica ``replica`` holds."""
        picture, count = self._held[replica], 0
        for key in hashes:
            if key not in picture:
                break
            count += 1
        return count

    def choose(self, loads: Sequence[float | None], hashes: Sequence[bytes]) -> Route:
        """The replica for a request with prefix ``hashes``; ``loads[i]`` is replica ``i``'s
        queued tokens, None while it is down. Raises ValueError when every replica is down."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no live replica to route to")
        least = min(loads[i] for i in live)  # type: ignore[type-var]
        best, best_key = None, None
        for i in live:
            held = self.held(i, hashes) if hashes else 0
            if held and loads[i] <= least + self.bound:  # type: ignore[operator]
                key = (0, -held, loads[i], i)  # a holder within the bound: longest prefix first
            else:
                key = (1, 0, loads[i], i)
            if best_key is None or key < best_key:
                best, best_key = Route(i, held), key
        return best  # type: ignore[return-value]

    def sent(self, replica: int, hashes: Sequence[bytes]) -> None:
        """Replica ``replica`` is computing (or re-using) these blocks: they are its most recent,
        the first block most of all (the engine frees a sequence's blocks tail first, so it
        evicts a prompt's tail before its prefix, which other prompts share)."""
        picture = self._held[replica]
        for key in reversed(hashes):
            picture[key] = None
            picture.move_to_end(key)
        while len(picture) > self.capacity[replica]:
            picture.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Replica ``replica`` lost its cache (its engine died): it holds nothing."""
        self._held[replica].clear()

    def resize(self, replica: int, capacity: int) -> None:
        """Replica ``replica``'s cache holds ``capacity`` blocks (its engine said so at start)."""
        self.capacity[replica] = capacity
        self.sent(replica, ())
