"""Idempotency keys shared by the gateways that share Redis: a retry a load balancer sends to
another gateway gets the first answer, and the request runs (and is billed) once.

Each (API key, Idempotency-Key) has two Redis keys: its answer (a hash: the request body's
digest, status, body; it expires after the store's ``ttl``) and a run lease, set with NX by the
gateway that runs the request and renewed while it runs. A gateway that finds neither takes the
lease and runs the request; one that finds the lease held waits for the answer, polling, and runs
it itself if the lease lapses (its holder died or its client went away). Within one gateway,
repeats still wait for the first as in :class:`~gateway.accounting.idempotency.IdempotencyStore`,
whose SQLite file stays this gateway's store while Redis does not answer (then the guarantee is
one gateway's). Only digests of the keys name them in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.typing import EncodableT

from gateway.accounting.idempotency import Answer, IdempotencyStore, Scope, Stored, check

log = logging.getLogger("ferry.gateway")

POLL = 0.05  # seconds between two looks for the answer of a request another gateway runs
LEASE = 10.0  # seconds a run lease lasts unless renewed (a third of it: renewed)
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class SharedIdempotencyStore(IdempotencyStore):
    """:class:`IdempotencyStore` whose answers and runs are shared through Redis (module doc)."""

    def __init__(self, path: str, url: str, timeout: float, ttl: float = 86_400.0,
                 max_entries: int = 1_000_000, prefix: str = "ferry:idem:") -> None:
        super().__init__(path, ttl, max_entries)
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                        retry=Retry(NoBackoff(), 0))
        self._prefix = prefix
        self._release = self._redis.register_script(_RELEASE)
        self._warned_at = -60.0

    async def aclose(self) -> None:
        self.close()
        await self._redis.aclose()

    async def _once(self, scope: Scope, digest: str,
                    compute: Callable[[], Awaitable[Answer]]) -> tuple[Answer, Stored | None]:
        name = self._prefix + hashlib.sha256("\0".join(scope).encode()).hexdigest()
        token = secrets.token_hex(8)
        try:
            stored = await self._claim(name, token)
        except (RedisError, OSError) as exc:
            self._warn(exc)
            return await super()._once(scope, digest, compute)  # this gateway's store alone
        if stored is not None:
            check(stored.fingerprint, digest, scope[1])
            return (stored.status, stored.body), stored
        holding = asyncio.create_task(self._hold(name + ":run", token))
        try:
            answer = await compute()
        finally:
            holding.cancel()
            with contextlib.suppress(RedisError, OSError):
                await self._release(keys=[name + ":run"], args=[token])
        kept = self.keep(scope, digest, answer)
        if kept is not None:
            try:
                fields: dict[EncodableT, EncodableT] = {
                    "fingerprint": digest, "status": answer[0], "body": answer[1],
                    "stored_at": kept.stored_at,
                }
                async with self._redis.pipeline(transaction=True) as both:  # one MULTI: never kept forever
                    both.hset(name, mapping=fields)
                    both.expire(name, max(1, int(self.ttl)))
                    await both.execute()
            except (RedisError, OSError) as exc:  # kept on this gateway's disk: a retry here finds it
                self._warn(exc)
        return answer, kept

    async def _claim(self, name: str, token: str) -> Stored | None:
        """The stored answer, or None once this gateway holds the run lease (waiting while
        another gateway holds it)."""
        while True:
            found = await self._redis.hgetall(name)
            if found:
                return _stored(found)
            if await self._redis.set(name + ":run", token, nx=True, px=int(LEASE * 1000)):
                if not await self._redis.exists(name):  # not answered between the look and the lease
                    return None
                await self._release(keys=[name + ":run"], args=[token])
                continue
            await asyncio.sleep(POLL)

    async def _hold(self, lease: str, token: str) -> None:
        """Renew the run lease while the request runs here."""
        with contextlib.suppress(RedisError, OSError):
            while True:
                await asyncio.sleep(LEASE / 3)
                if await self._redis.get(lease) != token.encode():
                    return
                await self._redis.pexpire(lease, int(LEASE * 1000))

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 10.0:
            self._warned_at = now
            log.warning("idempotency: Redis did not answer (%s); this gateway's own store serves",
                        type(exc).__name__)


def _stored(fields: Mapping[Any, Any]) -> Stored:
    """An answer as Redis holds it (bytes: the client decodes nothing)."""
    return Stored(fields[b"fingerprint"].decode(), int(fields[b"status"]), bytes(fields[b"body"]),
                  float(fields[b"stored_at"]))
