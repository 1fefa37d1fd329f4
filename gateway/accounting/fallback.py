"""Per-key limits through a Redis outage: which way they fail, and what it costs a request.

Redis stopped, frozen or restarting must not turn requests into 500s, hang them, or lose a
finished answer's bill. Every call to the shared store is bounded by ``timeout``, and limits
**fail open to this gateway's own buckets**: while Redis does not answer, each key is charged in
a local bucket with the same plan (N gateways admit up to N times its limit until Redis is
back), and a probe PINGs Redis until it answers again. A busy gateway is not an outage: at most
:data:`REDIS_CONNECTIONS` calls run at once, a call that timed out counts as failed only if a
thread's own PING goes unanswered too, and a charge with neither a verdict nor an outage in time
is a 529. Refunds are queued per key, coalesced, sent in the background and never dropped
(docs/admission.md; docs/STORES.md, "A busy gateway is not a Redis outage").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from batcher.core.errors import Shed
from gateway.accounting.ratelimit import Limiter, Limits, Verdict
from gateway.logs import Throttle

log = logging.getLogger("ferry.limiter")

FAILURES = (RedisError, OSError, TimeoutError)  # what an unreachable or frozen Redis raises
BACKOFF_START = 0.1  # seconds before the first probe of a store that went down...
BACKOFF_MAX = 5.0  # ...doubling up to this
REDIS_CONNECTIONS = 32
"""Calls to Redis in flight at once, and the connections the client's pool holds: a charge and a
refund take well under a millisecond each, so thousands of requests a second keep a few busy."""
CONFIRM_FACTOR = 4  # the thread's PING may take this many timeouts: Redis too may wait for a CPU
WAIT_FACTOR = 16
"""A charge waits at most this many call timeouts for its verdict (a connection, tries, PINGs),
and :data:`MIN_WAIT` at least: a call to a frozen Redis ends within ``1 + CONFIRM_FACTOR``, so
only a gateway too busy to run its calls waits that long."""
MIN_WAIT = 5.0  # seconds: hundreds of charges queued on a loaded machine still get theirs
BUSY_RETRY_AFTER = 1.0  # seconds: the Retry-After of a charge refused because no connection came free

T = TypeVar("T")


class SharedStore(Limiter, Protocol):
    async def ping(self) -> None:
        """Answer, or raise one of :data:`FAILURES`."""

    async def answers(self) -> bool:
        """Whether the store answers within the timeout, asked away from this event loop."""


class _Down(Exception):
    """The store went down while a call waited for a connection: serve it locally."""


@dataclasses.dataclass(slots=True)
class _Refund:
    limits: Limits  # the key's plan when the last of these refunds was made
    tokens: float
    requests: float


class FallbackLimiter:
    """A Redis limiter whose every call is bounded, with a local bucket per key while it is down."""

    def __init__(self, shared: SharedStore, local: Limiter, timeout: float,
                 connections: int = REDIS_CONNECTIONS) -> None:
        self.shared = shared
        self.timeout = timeout
        self.local = local
        self.up = True
        self.fallbacks = 0  # charges made in a local bucket
        self.busy = 0  # charges refused (529): no connection came free within the wait
        self.failures = 0  # calls to Redis that failed or timed out
        self.late = 0  # calls that timed out while Redis answered: this gateway's loop was busy
        self.pending: dict[str, _Refund] = {}  # refunds not yet sent, per key
        self._connections = asyncio.Semaphore(connections)
        self._down_since = 0.0
        self._throttle = Throttle(burst=1)
        self._probe: asyncio.Task[None] | None = None
        self._asking: asyncio.Future[bool] | None = None  # one answers() for every call that timed out
        self._senders: dict[str, asyncio.Task[None]] = {}  # the task sending each key's refunds

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        if self.up:
            try:
                return await self._call(lambda: self.shared.acquire(key, limits, tokens, requests),
                                        self._wait())
            except _Down:
                pass
            except FAILURES as exc:
                self._failed(exc)
        self.fallbacks += 1
        return await self.local.acquire(key, limits, tokens, requests)

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        if not self.up:
            await self.local.refund(key, limits, tokens, requests)
            return
        pending = self.pending.get(key)
        if pending is None:
            self.pending[key] = _Refund(limits, tokens, requests)
        else:
            pending.limits = limits
            pending.tokens, pending.requests = pending.tokens + tokens, pending.requests + requests
        self._send(key)

    async def aclose(self) -> None:
        """Let the refunds in flight finish (as long as a charge may wait: a refund tries again
        while Redis answers PINGs), stop probing, close the client."""
        if self._senders:
            _, unsent = await asyncio.wait(set(self._senders.values()), timeout=self._wait())
            for task in unsent:
                task.cancel()
            if unsent:
                await asyncio.wait(unsent)
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait({self._probe})
        try:
            async with asyncio.timeout(self.timeout):
                await self.shared.aclose()
        except FAILURES:
            pass  # nothing left to tell a store that does not answer

    async def _call(self, call: Callable[[], Awaitable[T]], wait: float | None) -> T:
        """``call`` on a free connection, each try bounded by the timeout, tried again while a
        thread's PING says Redis answers, for ``wait`` seconds at most (None: as long as it
        answers). Raises :class:`_Down` if the store went down meanwhile, :class:`Shed` when
        ``wait`` ran out, or what a try raised when Redis does not answer."""
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        try:
            async with asyncio.timeout_at(deadline):
                await self._connections.acquire()
        except TimeoutError:
            raise self._busy() from None
        try:
            while True:
                if not self.up:
                    raise _Down
                try:
                    async with asyncio.timeout(self.timeout):
                        return await call()
                except (TimeoutError, RedisTimeout):
                    if not await self._answers():
                        raise
                self.late += 1  # Redis answers: this loop was too busy to read the reply in time
                if deadline is not None and loop.time() >= deadline:
                    raise self._busy()
        finally:
            self._connections.release()

    def _wait(self) -> float:
        """How long a charge may wait for its verdict."""
        return max(WAIT_FACTOR * self.timeout, MIN_WAIT)

    def _busy(self) -> Exception:
        """What a charge that ran out of its wait raises: a 529, or local buckets if Redis went down."""
        if not self.up:
            return _Down()
        self.busy += 1
        return Shed("per-key limits: the limits store could not be reached in time; retry", BUSY_RETRY_AFTER)

    async def _answers(self) -> bool:
        """Whether Redis answers when asked away from this event loop (one question at a time)."""
        if self._asking is None:
            asking = self._asking = asyncio.ensure_future(self.shared.answers())
            asking.add_done_callback(lambda _: setattr(self, "_asking", None))
        return await asyncio.shield(self._asking)

    def _send(self, key: str) -> None:
        """Start sending ``key``'s queued refunds, unless a task already does."""
        if key not in self._senders:
            task = self._senders[key] = asyncio.ensure_future(self._send_refunds(key))
            task.add_done_callback(lambda _: self._senders.pop(key, None))

    async def _send_refunds(self, key: str) -> None:
        """Send the key's queued refunds, one call for all queued since the last, until none is
        left; one that fails goes back to the queue, to be sent when Redis answers again."""
        while self.up and key in self.pending:
            refund = self.pending.pop(key)
            try:
                await self._call(
                    functools.partial(self.shared.refund, key, refund.limits, refund.tokens, refund.requests),
                    None)
            except (_Down, *FAILURES) as exc:
                later = self.pending.setdefault(key, _Refund(refund.limits, 0, 0))
                later.tokens, later.requests = later.tokens + refund.tokens, later.requests + refund.requests
                if not isinstance(exc, _Down):
                    self._failed(exc)
                return

    def _failed(self, error: BaseException) -> None:
        self.failures += 1
        if self.up:
            self.up = False
            self._down_since = time.monotonic()
            self._probe = asyncio.ensure_future(self._until_it_answers())
        suppressed = self._throttle.admit()
        if suppressed is not None:
            log.warning("redis did not answer within %.0f ms (%s): per-key limits use this gateway's local "
                        "buckets until it does (%d more failures since the last line)",
                        self.timeout * 1000, type(error).__name__, suppressed)

    async def _until_it_answers(self) -> None:
        delay = BACKOFF_START
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self.timeout):
                    await self.shared.ping()
            except FAILURES:
                self.failures += 1
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self.up = True
            log.warning("redis answers again after %.1f s: per-key limits are shared again",
                        time.monotonic() - self._down_since)
            for key in list(self.pending):
                self._send(key)
            return


class LimiterCollector(Collector):
    """``ferry_limiter_store_up``, ``..._refunds_pending``, ``ferry_limiter_fallbacks_total``,
    ``..._busy_total``, ``..._late_total`` and ``..._store_failures_total``, read from the limiter
    at scrape time."""

    def __init__(self, limiter: FallbackLimiter) -> None:
        self.limiter = limiter

    def collect(self) -> Iterator:
        limiter = self.limiter
        up = GaugeMetricFamily(
            "ferry_limiter_store_up", "1 while the shared limits store (Redis) answers, else 0."
        )
        up.add_metric([], 1 if limiter.up else 0)
        yield up
        pending = GaugeMetricFamily(
            "ferry_limiter_refunds_pending", "Keys with refunds not yet in Redis (queued, or waiting for it)."
        )
        pending.add_metric([], len(limiter.pending))
        yield pending
        for name, help_text, value in (
            ("ferry_limiter_fallbacks", "Charges made in this gateway's local bucket: Redis was down.",
             limiter.fallbacks),
            ("ferry_limiter_busy", "Charges refused (529): no connection to Redis came free in time.",
             limiter.busy),
            ("ferry_limiter_late", "Calls that timed out while Redis answered (a busy loop), made again.",
             limiter.late),
            ("ferry_limiter_store_failures", "Calls to Redis that failed or did not answer in time.",
             limiter.failures),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], value)
            yield family
