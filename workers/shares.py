"""Weighted fair shares among the tenants of one tier: the least served tenant goes next. Pure.

A tenant's *service* is the work it has been given over its ``weight`` (the Virtual Token
Counter's rule: requests in the fixed mode, tokens in the continuous one). Each tenant's items
wait in a FIFO of their own; the next item is the front of the tenant with work whose service
is least (ties: the one that has had work longest). A tenant that gets work after having none
is lifted to the least service of those with work (or to where service stood when the last one
left), so time spent idle banks no credit::

    join(t)   service[t] = max(service[t], least service of those with work)
    next      the front of argmin service[t] over those with work
    charge    service[t] += cost / weight[t]
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flow(Generic[T]):
    """One tenant's items and service. ``entry`` numbers its place in the heap while it has work
    (-1 while it has none): an entry of another number is stale."""

    __slots__ = ("backlog", "entry", "items", "live", "served", "tenant", "weight")

    def __init__(self, tenant: str, weight: float) -> None:
        self.tenant, self.weight = tenant, weight
        self.items: deque[T] = deque()
        self.live = 0
        self.backlog = 0.0
        self.served = 0.0
        self.entry = -1


class FairQueue(Generic[T]):
    """The items of one tier, by weighted fair shares among their tenants (see the module doc).

    ``tenant(item)`` names an item's tenant, ``cost(item)`` its work waiting (None: 1 an item,
    a request; the tokens to prefill for an engine's job) and ``live(item)`` whether it still waits: one
    that left (cancelled, expired) is dropped when it reaches the front of its tenant's FIFO, its
    owner having told :meth:`forget` at once, so that the counts are always right. A weight not
    in ``weights`` is 1.
    """

    def __init__(self, weights: Mapping[str, float], tenant: Callable[[T], str],
                 live: Callable[[T], bool], cost: Callable[[T], float] | None = None) -> None:
        self.weights = weights
        self.count = 0  # live items
        self._tenant, self._live, self._cost = tenant, live, cost
        self._flows: dict[str, _Flow[T]] = {}
        self._active: dict[str, _Flow[T]] = {}  # the flows with live items
        self._heap: list[tuple[float, int, _Flow[T]]] = []  # (served, entry, flow); stale ones skipped
        self._entries = itertools.count()
        self._level = 0.0  # the least service with work, as it stood at the last item taken

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[T]:
        """The live items, each tenant's in its order."""
        live = self._live
        return (item for flow in self._active.values() for item in flow.items if live(item))

    @property
    def tenants(self) -> int:
        """How many tenants have items waiting."""
        return len(self._active)

    def backlog(self, tenant: str) -> float:
        """The work ``tenant`` has waiting."""
        flow = self._active.get(tenant)
        return flow.backlog if flow is not None else 0.0

    def backlogs(self) -> Iterator[tuple[str, float]]:
        """Each tenant with work waiting, and that work."""
        return ((flow.tenant, flow.backlog) for flow in self._active.values())

    def push(self, item: T) -> None:
        """Queue ``item`` at the back of its tenant's FIFO."""
        flow = self._flow(self._tenant(item))
        flow.items.append(item)
        flow.live += 1
        flow.backlog += 1.0 if self._cost is None else self._cost(item)
        self.count += 1
        if flow.live == 1:
            self._join(flow)

    def forget(self, item: T) -> None:
        """A live item has left (it is no longer ``live``): out of the counts now, out of its FIFO
        when it reaches the front."""
        flow = self._flows[self._tenant(item)]
        self.count -= 1
        flow.live -= 1
        flow.backlog -= 1.0 if self._cost is None else self._cost(item)
        if not flow.live:
            self._leave(flow)

    def front(self) -> T | None:
        """The next item (see the module doc), or None when none waits."""
        flow = self._next()
        return None if flow is None else self._front_of(flow)

    def pop(self, charge: float | None = None) -> T:
        """Take the next item out, charging its tenant its cost (or ``charge``)."""
        flow = self._next()
        if flow is None:
            raise IndexError("pop from an empty fair queue")
        items, live = flow.items, self._live
        while not live(items[0]):  # it has a live item: the loop ends
            items.popleft()
        item = items.popleft()
        if flow.served > self._level:
            self._level = flow.served
        cost = 1.0 if self._cost is None else self._cost(item)
        flow.served += (cost if charge is None else charge) / flow.weight
        self.count -= 1
        flow.live -= 1
        flow.backlog -= cost
        if not flow.live:
            self._leave(flow)
        return item

    def charge(self, tenant: str, cost: float) -> None:
        """``tenant`` has been given ``cost`` more work (an item taken; an engine's tokens)."""
        flow = self._flow(tenant)
        flow.served += cost / flow.weight

    def ahead(self, tenant: str) -> float:
        """The work waiting here that is taken before a new item of ``tenant``: its own, and what
        every other tenant is given until its service passes the new item's start (ties to
        them: they have had work longer). With one tenant, all of it."""
        flow = self._active.get(tenant)
        if flow is not None:
            own, start = flow.backlog, flow.served + flow.backlog / flow.weight
        else:
            known = self._flows.get(tenant)
            own, start = 0.0, max(known.served if known is not None else 0.0, self._least())
        total, size = own, self._cost
        for other in self._active.values():
            if other is not flow and other.served <= start:
                first = 1.0 if size is None else size(self._front_of(other))
                total += min(other.backlog, (start - other.served) * other.weight + first)
        return total

    def fronts(self) -> Iterator[T]:
        """The front item of every tenant with work."""
        return (self._front_of(flow) for flow in self._active.values())

    def reweigh(self, weights: Mapping[str, float]) -> None:
        """New weights, for every tenant's service from now on."""
        self.weights = weights
        for flow in self._flows.values():
            flow.weight = weights.get(flow.tenant, 1.0)

    def _flow(self, tenant: str) -> _Flow[T]:
        flow = self._flows.get(tenant)
        if flow is None:
            flow = self._flows[tenant] = _Flow(tenant, self.weights.get(tenant, 1.0))
        return flow

    def _front_of(self, flow: _Flow[T]) -> T:
        """The first live item of a tenant with work (the items before it have left)."""
        items, live = flow.items, self._live
        while not live(items[0]):  # it has a live item: the loop ends
            items.popleft()
        return items[0]

    def _least(self) -> float:
        """The least service among tenants with work, else where it stood when the last one left."""
        flow = self._next()
        return flow.served if flow is not None else self._level

    def _join(self, flow: _Flow[T]) -> None:
        flow.served = max(flow.served, self._least())
        flow.entry = next(self._entries)
        self._active[flow.tenant] = flow
        heapq.heappush(self._heap, (flow.served, flow.entry, flow))

    def _leave(self, flow: _Flow[T]) -> None:
        flow.entry = -1
        flow.items.clear()  # every item left in it has left the queue
        del self._active[flow.tenant]
        if not self._active:  # every entry is stale: drop them now (one tenant alone never pops)
            self._heap.clear()

    def _next(self) -> _Flow[T] | None:
        """The tenant with work whose service is least; the heap's stale entries dropped (left
        in it while one tenant alone has work: it is the next whatever its service)."""
        if len(self._active) == 1:
            for flow in self._active.values():
                return flow
        heap = self._heap
        while heap:
            served, entry, flow = heap[0]
            if flow.entry != entry:
                heapq.heappop(heap)
            elif flow.served != served:  # charged since: service only grows, so push it back
                heapq.heapreplace(heap, (flow.served, entry, flow))
            else:
                return flow
        return None
