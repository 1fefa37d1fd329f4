"""Which engine replica a new request goes to: least queued tokens, with bounded prefix affinity.

Pure. **Load** is queued tokens: what a replica still owes its jobs, queued or running (tokens,
not requests, are what a step costs). **Prefix** is the hash chain of the prompt's full blocks
(:func:`workers.prefix_hash.prefix_hashes`, the engine's own keys); per replica the router
remembers the hashes it sent there, as many as its cache holds, in the engine's LRU order
(why, and the bound: docs/continuous.md, "Routing")::

    least   = the smallest load among live replicas
    holders = live replicas holding >= 1 block of the prefix, whose load <= least + bound
    winner  = the holder with the longest held prefix (then less load, then lower index),
              else the least-loaded live replica (then lower index)"""

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
        live = [(i, load) for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no live replica to route to")
        least = min(load for _, load in live)
        best: Route | None = None
        best_key: tuple[int, int, float, int] | None = None
        for i, load in live:
            held = self.held(i, hashes) if hashes else 0
            if held and load <= least + self.bound:
                key = (0, -held, load, i)  # a holder within the bound: longest prefix first
            else:
                key = (1, 0, load, i)
            if best_key is None or key < best_key:
                best, best_key = Route(i, held), key
        assert best is not None, "a live replica was chosen"
        return best

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
