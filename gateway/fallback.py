"""Per-key limits through a Redis outage: which way they fail, and what it costs a request.

Redis stopped, frozen (SIGSTOP) or restarting must not turn requests into 500s, hang them, or
lose a finished answer's bill. So every call to the shared store is bounded by ``timeout``
(``[limits] redis_timeout_ms``), and limits **fail open to this gateway's own buckets**: while
Redis does not answer, each key is charged in a local in-memory bucket with the same plan, so a
key is still limited, by each gateway alone (N gateways admit up to N times its limit until
Redis is back), and nobody is refused for an outage that is not theirs::

    up    acquire ──Redis, within timeout──> verdict
            │ an error or no answer in time: down (one warning line per interval)
            v
    down  acquire ──local bucket──> verdict           (counted: ferry_limiter_fallbacks_total)
          a probe PINGs Redis after 0.1 s, 0.2 s, ... up to 5 s; the first answer: up again

A refund never holds up or fails the request it belongs to: it is sent in the background (to
Redis while it is up, else to the local bucket where the charge most likely went), and one that
cannot reach Redis is dropped and counted (``ferry_limiter_refunds_dropped_total``): the key
is then short of that budget until its bucket refills, at most a minute, which errs on the safe
side. The state is exported as ``ferry_limiter_store_up`` (1 or 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from gateway.logs import Throttle
from gateway.ratelimit import Limits, Verdict

if TYPE_CHECKING:  # gateway.limiter builds this class in open_limiter
    from gateway.limiter import MemoryLimiter, RedisLimiter

log = logging.getLogger("ferry.limiter")

FAILURES = (RedisError, OSError, TimeoutError)  # what an unreachable or frozen Redis raises
BACKOFF_START = 0.1  # seconds before the first probe of a store that went down...
BACKOFF_MAX = 5.0  # ...doubling up to this
MAX_PENDING_REFUNDS = 1024  # refunds in flight at once; more are dropped (and counted)


class FallbackLimiter:
    """A Redis limiter whose every call is bounded, with a local bucket per key while it is down."""

    def __init__(self, shared: RedisLimiter, local: MemoryLimiter, timeout: float) -> None:
        self.shared = shared
        self.timeout = timeout
        self.local = local
        self.up = True
        self.fallbacks = 0  # charges made in a local bucket
        self.refunds_dropped = 0
        self.failures = 0  # calls to Redis that failed or timed out
        self._down_since = 0.0
        self._throttle = Throttle(burst=1)
        self._probe: asyncio.Task[None] | None = None
        self._refunds: set[asyncio.Task[None]] = set()

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        if self.up:
            try:
                async with asyncio.timeout(self.timeout):
                    return await self.shared.acquire(key, limits, tokens, requests)
            except FAILURES as exc:
                self._failed(exc)
        self.fallbacks += 1
        return await self.local.acquire(key, limits, tokens, requests)

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        if not self.up:
            await self.local.refund(key, limits, tokens, requests)
        elif len(self._refunds) >= MAX_PENDING_REFUNDS:
            self.refunds_dropped += 1
        else:
            task = asyncio.ensure_future(self._refund_shared(key, limits, tokens, requests))
            self._refunds.add(task)
            task.add_done_callback(self._refunds.discard)

    async def aclose(self) -> None:
        """Let the refunds in flight finish (each is bounded), stop probing, close the client."""
        if self._refunds:
            await asyncio.wait(set(self._refunds))
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait({self._probe})
        try:
            async with asyncio.timeout(self.timeout):
                await self.shared.aclose()
        except FAILURES:
            pass  # nothing left to tell a store that does not answer

    async def _refund_shared(self, key: str, limits: Limits, tokens: float, requests: float) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.shared.refund(key, limits, tokens, requests)
        except FAILURES as exc:
            self.refunds_dropped += 1
            self._failed(exc)

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
            return


class LimiterCollector(Collector):
    """``ferry_limiter_store_up``, ``ferry_limiter_fallbacks_total``, ``..._refunds_dropped_total``
    and ``..._store_failures_total``, read from the limiter at scrape time."""

    def __init__(self, limiter: FallbackLimiter) -> None:
        self.limiter = limiter

    def collect(self) -> Iterator:
        limiter = self.limiter
        up = GaugeMetricFamily("ferry_limiter_store_up", "1 while the shared limits store (Redis) answers, else 0.")
        up.add_metric([], 1 if limiter.up else 0)
        yield up
        for name, help_text, value in (
            ("ferry_limiter_fallbacks", "Charges made in this gateway's local bucket: Redis was down.",
             limiter.fallbacks),
            ("ferry_limiter_refunds_dropped", "Refunds that could not reach Redis, dropped.",
             limiter.refunds_dropped),
            ("ferry_limiter_store_failures", "Calls to Redis that failed or did not answer in time.",
             limiter.failures),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], value)
            yield family
