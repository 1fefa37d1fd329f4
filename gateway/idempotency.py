"""Idempotency keys: a repeated non-streamed request gets the first answer, never a second run.

Seed 000 §3.2, §6.3: a client that lost a response retries with the same ``Idempotency-Key``;
the gateway must neither run nor bill it twice. Keys are scoped to the API key that sent them.

- A key seen for the first time runs the request. Concurrent repeats wait for that run and get
  its answer. If the run is abandoned (its client went away), one waiter runs it instead.
- A successful answer (200) is kept in SQLite, so a repeat after a gateway restart still gets it.
  Failures are not kept: a 529 or a worker failure was not billed, and the retry should run.
- A repeat whose body differs from the first is a client bug: :class:`KeyReused` (400).

The stored row holds the response body (it is what the client paid for) and a digest of the
request body, never the request itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from collections.abc import Awaitable, Callable

from gateway.api import InvalidRequest
from gateway.private import private_database

Answer = tuple[int, bytes]  # HTTP status and body

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    key_id      TEXT NOT NULL,
    idem_key    TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status      INTEGER NOT NULL,
    body        BLOB NOT NULL,
    PRIMARY KEY (key_id, idem_key)
)
"""


class KeyReused(InvalidRequest):
    """The Idempotency-Key was used before with a different request body (400)."""


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class IdempotencyStore:
    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(private_database(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._running: dict[tuple[str, str], tuple[str, asyncio.Future[Answer]]] = {}

    def close(self) -> None:
        self._db.close()

    async def run(self, key_id: str, idem_key: str, body: bytes, compute: Callable[[], Awaitable[Answer]]) -> Answer:
        """The answer for this (key, Idempotency-Key): stored, awaited, or computed once now."""
        scope, digest = (key_id, idem_key), fingerprint(body)
        while True:
            row = self._db.execute(
                "SELECT fingerprint, status, body FROM idempotency WHERE key_id = ? AND idem_key = ?", scope
            ).fetchone()
            if row is not None:
                _check(row[0], digest, idem_key)
                return row[1], row[2]
            running = self._running.get(scope)
            if running is None:
                return await self._compute(scope, digest, compute)
            _check(running[0], digest, idem_key)
            try:
                return await asyncio.shield(running[1])
            except asyncio.CancelledError:
                if not running[1].cancelled():
                    raise  # this waiter itself was cancelled
                # the first run was abandoned: loop, and run it here

    async def _compute(self, scope: tuple[str, str], digest: str, compute: Callable[[], Awaitable[Answer]]) -> Answer:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._running[scope] = (digest, future)
        try:
            status, body = await compute()
        except BaseException:
            future.cancel()
            raise
        finally:
            del self._running[scope]
        if status == 200:
            self._db.execute("INSERT OR IGNORE INTO idempotency VALUES (?, ?, ?, ?, ?)", (*scope, digest, status, body))
        future.set_result((status, body))
        return status, body


def _check(stored: str, digest: str, idem_key: str) -> None:
    if stored != digest:
        raise KeyReused(f"Idempotency-Key: {idem_key!r} was already used with a different request body")
