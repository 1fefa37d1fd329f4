"""Where per-key buckets live: in this process, in Redis (shared by gateways), or leased from Redis.

All three stores run the arithmetic of :mod:`gateway.accounting.ratelimit`; they differ only in who holds
the state. One gateway keeps it in memory. Several gateways keep it in Redis, charged by one Lua
script so that a check-and-take is atomic across them. For a hot key, a gateway
may lease a slice of the shared budget and serve from it locally, going back to Redis only when
the slice runs out: fewer round trips, and still never more admitted than the limit, since every
leased token was charged in Redis first. A lease not used up within its ``ttl`` goes back.
Redis is always reached through :class:`~gateway.accounting.fallback.FallbackLimiter`: bounded calls, and
this gateway's own buckets while Redis does not answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry as BlockingRetry

from gateway.accounting.fallback import CONFIRM_FACTOR, REDIS_CONNECTIONS, FallbackLimiter, LimiterCollector
from gateway.accounting.ratelimit import Bucket, Limiter, Limits, Verdict, charge, full, refund
from gateway.config import LimitsConfig

Clock = Callable[[], float]


def open_limiter(config: LimitsConfig, registry: CollectorRegistry | None = None) -> Limiter:
    """The store a configuration names, leased when it asks for a lease share. Redis is reached
    through a :class:`~gateway.accounting.fallback.FallbackLimiter` (every call bounded, local buckets while
    it is down), whose state and counts go to ``registry``."""
    if config.store == "memory":
        return MemoryLimiter()
    timeout = config.redis_timeout_ms / 1000
    shared = FallbackLimiter(
        RedisLimiter.from_url(config.redis_url, timeout=timeout), MemoryLimiter(), timeout
    )
    if registry is not None:
        registry.register(LimiterCollector(shared))
    return LeasedLimiter(shared, config.lease_share) if config.lease_share > 0 else shared


class MemoryLimiter:
    """Buckets in a dict: one gateway process."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[Bucket, ...]] = {}

    def _state(self, key: str, capacities: tuple[float, ...], now: float) -> tuple[Bucket, ...]:
        return self._buckets.get(key) or tuple(full(capacity, now) for capacity in capacities)

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        now, capacities = self._clock(), limits.capacities
        verdict, self._buckets[key] = charge(
            self._state(key, capacities, now), capacities, (tokens, requests), now
        )
        return verdict

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        now, capacities = self._clock(), limits.capacities
        state = self._state(key, capacities, now)
        self._buckets[key] = tuple(
            refund(bucket, capacity, amount, now)
            for bucket, capacity, amount in zip(state, capacities, (tokens, requests), strict=False)
        )

    async def aclose(self) -> None:
        pass


# The same arithmetic as gateway.accounting.ratelimit.charge/refund, atomically inside Redis. An unlimited
# dimension has capacity -1. It answers the wait and the two levels after the call. ARGV[6], when
# given, replaces Redis's clock (tests compare verdicts with the pure core at exact times);
# otherwise every gateway shares the server's TIME.
_SCRIPT = """
local now
if ARGV[6] then now = tonumber(ARGV[6]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local amounts = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local state = redis.call('HMGET', KEYS[1], 'l1', 'u1', 'l2', 'u2')
local levels = {}
for i = 1, 2 do
  local cap, level = caps[i], tonumber(state[2 * i - 1])
  if cap >= 0 then
    if level == nil then levels[i] = cap else
      levels[i] = math.min(cap, level + math.max(0, now - tonumber(state[2 * i])) * cap / 60) end
  end
end
local wait = 0
for i = 1, 2 do
  local cap = caps[i]
  if cap >= 0 then
    if ARGV[5] == 'refund' then levels[i] = math.min(cap, levels[i] + amounts[i])
    elseif amounts[i] > cap then wait = math.huge
    elseif amounts[i] > levels[i] then wait = math.max(wait, (amounts[i] - levels[i]) / (cap / 60)) end
  end
end
if ARGV[5] == 'charge' and wait == 0 then
  for i = 1, 2 do if caps[i] >= 0 then levels[i] = levels[i] - amounts[i] end end
end
local fields = {}
for i = 1, 2 do
  if caps[i] >= 0 then
    table.insert(fields, 'l' .. i); table.insert(fields, string.format('%.17g', levels[i]))
    table.insert(fields, 'u' .. i); table.insert(fields, string.format('%.17g', now))
  end
end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)); redis.call('EXPIRE', KEYS[1], 120) end
local shown = {}
for i = 1, 2 do
  shown[i] = 'inf'
  if caps[i] >= 0 then shown[i] = string.format('%.17g', levels[i]) end
end
if wait == math.huge then return {'inf', shown[1], shown[2]} end
return {string.format('%.17g', wait), shown[1], shown[2]}
"""


class RedisLimiter:
    """Buckets in Redis, one hash per API key, charged by one atomic script: shared by gateways."""

    def __init__(self, client: aioredis.Redis, prefix: str = "ferry:limit:", clock: Clock | None = None,
                 beside: redis.Redis | None = None) -> None:
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._beside = beside  # a blocking client on the same server, for answers()
        self._script = client.register_script(_SCRIPT)

    @classmethod
    def from_url(cls, url: str, timeout: float | None = None, **kwargs) -> RedisLimiter:
        """A limiter on the Redis at ``url``; with a ``timeout``, each socket connect and read is
        bounded by it and redis-py retries nothing (the caller decides what a failure means).

        The pool holds at most :data:`~gateway.accounting.fallback.REDIS_CONNECTIONS`, as many as the
        :class:`~gateway.accounting.fallback.FallbackLimiter` lets run at once, so the pool never runs dry
        under it: a call beyond them waits there for a call in flight to end (a busy gateway),
        which tells it apart from a Redis that does not answer."""
        if timeout is None:
            return cls(aioredis.from_url(url, max_connections=REDIS_CONNECTIONS), **kwargs)
        client = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                   retry=Retry(NoBackoff(), 0), max_connections=REDIS_CONNECTIONS)
        confirm = CONFIRM_FACTOR * timeout
        beside = redis.Redis.from_url(url, socket_timeout=confirm, socket_connect_timeout=confirm,
                                      retry=BlockingRetry(NoBackoff(), 0))
        return cls(client, beside=beside, **kwargs)

    async def ping(self) -> None:
        await self._client.ping()

    async def answers(self) -> bool:
        """Whether Redis answers a PING on a thread's own connection, within the timeouts the
        kernel keeps: a call that timed out on a busy event loop may have had its reply waiting,
        unread."""
        return self._beside is not None and await asyncio.to_thread(self._ping_beside)

    def _ping_beside(self) -> bool:
        assert self._beside is not None, "answers() pings the client it has"
        try:
            return bool(self._beside.ping())
        except (RedisError, OSError):
            return False

    async def _run(self, key: str, limits: Limits, tokens: float, requests: float, mode: str) -> Verdict:
        capacities = [-1 if math.isinf(c) else c for c in limits.capacities]
        args = [*capacities, tokens, requests, mode]
        if self._clock is not None:
            args.append(repr(self._clock()))
        answer = await self._script(keys=[self._prefix + key], args=args)
        wait, tokens_left, requests_left = map(float, answer)
        return Verdict(wait == 0.0, wait, (tokens_left, requests_left))

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        return await self._run(key, limits, tokens, requests, "charge")

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        await self._run(key, limits, tokens, requests, "refund")

    async def aclose(self) -> None:
        if self._beside is not None:
            self._beside.close()
        await self._client.aclose()


@dataclasses.dataclass(slots=True)
class _Lease:
    tokens: float
    requests: float
    expires: float
    limits: Limits  # the key's plan, to give back what is left


class LeasedLimiter:
    """Serve each key from a local slice of its shared budget; lease again when it runs out.

    A slice is ``share`` of the key's per-minute limits (at least the request at hand). Each
    gateway may hold one slice per key for ``ttl`` seconds; leftovers go back to the shared store.
    """

    def __init__(
        self, shared: Limiter, share: float = 0.02, ttl: float = 1.0, clock: Clock = time.monotonic
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"lease share: expected 0 < share <= 1, got {share}")
        self._shared = shared
        self._share = share
        self._ttl = ttl
        self._clock = clock
        self._leases: dict[str, _Lease] = {}

    async def acquire(self, key: str, limits: Limits, tokens: float, requests: float = 1) -> Verdict:
        now = self._clock()
        lease = self._leases.get(key)
        if (
            lease is not None
            and lease.expires > now
            and lease.tokens >= tokens
            and lease.requests >= requests
        ):
            lease.tokens -= tokens
            lease.requests -= requests
            return Verdict(True)
        await self._return(key)
        slice_tokens, slice_requests = (
            amount if math.isinf(capacity) else max(amount, capacity * self._share)
            for amount, capacity in zip((tokens, requests), limits.capacities, strict=False)
        )
        verdict = await self._shared.acquire(key, limits, slice_tokens, slice_requests)
        if verdict.admitted:
            self._leases[key] = _Lease(
                slice_tokens - tokens, slice_requests - requests, now + self._ttl, limits
            )
            return verdict
        return await self._shared.acquire(key, limits, tokens, requests)  # no slice: just this one

    async def refund(self, key: str, limits: Limits, tokens: float, requests: float = 0) -> None:
        lease = self._leases.get(key)
        if lease is not None and lease.expires > self._clock():
            lease.tokens += tokens
            lease.requests += requests
        else:
            await self._shared.refund(key, limits, tokens, requests)

    async def aclose(self) -> None:
        for key in list(self._leases):
            await self._return(key)
        await self._shared.aclose()

    async def _return(self, key: str) -> None:
        lease = self._leases.pop(key, None)
        if lease is not None and (lease.tokens > 0 or lease.requests > 0):
            await self._shared.refund(key, lease.limits, lease.tokens, lease.requests)
