"""Idempotency keys: a repeated non-streamed request gets the first answer, never a second run.

A client that lost a response retries with the same ``Idempotency-Key`` (scoped to its API
key); the gateway must neither run nor bill it twice. The first request with a key runs, and
concurrent repeats wait for its answer (one of them runs it if its client went away); a 200 is
kept for ``ttl`` seconds, also across a restart, while failures are not kept (the retry runs);
a repeat with another body is a client bug (:class:`KeyReused`, 400). Nothing blocks the event
loop: the newest answers (:data:`RECENT`) are held in memory, older ones are looked up by a
reader thread and written by a writer thread (:mod:`gateway.accounting.sqlite_writer`). A row
holds the response body and a digest of the request body, never the request itself; the file
is the gateway's user's alone (:mod:`gateway.accounting.private`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import sqlite3
import time
from collections.abc import Awaitable, Callable

from gateway.accounting.private import private_database
from gateway.accounting.sqlite_writer import SqliteWriter
from gateway.wire.api import InvalidRequest

Answer = tuple[int, bytes]  # HTTP status and body
Scope = tuple[str, str]  # (key id, Idempotency-Key)

RECENT = 10_000  # answers kept in memory as well, newest first out last
PURGE_INTERVAL = 60.0  # seconds between two sweeps of expired rows

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    key_id      TEXT NOT NULL,
    idem_key    TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status      INTEGER NOT NULL,
    body        BLOB NOT NULL,
    stored_at   REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (key_id, idem_key)
);
"""
# A table from before answers expired gets stored_at = 0: its rows count as expired.
_MIGRATIONS = {
    "idempotency": {"stored_at": "ALTER TABLE idempotency ADD COLUMN stored_at REAL NOT NULL DEFAULT 0"}
}
_INDEX = "CREATE INDEX IF NOT EXISTS idempotency_stored_at ON idempotency (stored_at)"
_INSERT = "INSERT OR IGNORE INTO idempotency VALUES (?, ?, ?, ?, ?, ?)"
_SELECT = "SELECT fingerprint, status, body, stored_at FROM idempotency WHERE key_id = ? AND idem_key = ?"
_EXPIRE = "DELETE FROM idempotency WHERE stored_at < ?"
_OVERFLOW = ("DELETE FROM idempotency WHERE rowid IN "
             "(SELECT rowid FROM idempotency ORDER BY stored_at DESC LIMIT -1 OFFSET ?)")


class KeyReused(InvalidRequest):
    """The Idempotency-Key was used before with a different request body (400)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    fingerprint: str
    status: int
    body: bytes
    stored_at: float  # time.time(): it must mean the same after a restart


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class IdempotencyStore:
    def __init__(self, path: str, ttl: float = 86_400.0, max_entries: int = 1_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._writer = SqliteWriter(
            private_database(path), _SCHEMA + _INDEX + ";", "idempotency-writer", _MIGRATIONS
        )
        self._db: sqlite3.Connection  # the reader thread's own connection, opened first thing there
        self._reader = concurrent.futures.ThreadPoolExecutor(
            1, "idempotency-reader", initializer=self._open_reader, initargs=(path,)
        )
        self._recent: collections.OrderedDict[Scope, Stored] = collections.OrderedDict()
        self._running: dict[Scope, tuple[str, asyncio.Future[Answer]]] = {}
        self._lookups: list[tuple[Scope, asyncio.Future[Stored | None]]] = []  # not yet sent to the reader
        self._looking = False  # a batch of lookups is on its way to the reader or back
        self._purged_at = -PURGE_INTERVAL
        self._purge()

    def close(self) -> None:
        self._writer.close()
        self._reader.submit(lambda: self._db.close()).result()
        self._reader.shutdown()

    async def run(
        self, key_id: str, idem_key: str, body: bytes, compute: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        """The answer for this (key, Idempotency-Key): stored, awaited, or computed once now."""
        scope, digest = (key_id, idem_key), fingerprint(body)
        while True:
            stored = self._recent_answer(scope)
            if stored is not None:
                check(stored.fingerprint, digest, idem_key)
                return stored.status, stored.body
            running = self._running.get(scope)
            if running is None:
                return await self._compute(scope, digest, compute)
            check(running[0], digest, idem_key)
            try:
                return await asyncio.shield(running[1])
            except asyncio.CancelledError:
                if not running[1].cancelled():
                    raise  # this waiter itself was cancelled
                # the first run was abandoned: loop, and run it here

    def _recent_answer(self, scope: Scope) -> Stored | None:
        stored = self._recent.get(scope)
        if stored is not None and stored.stored_at < self._clock() - self.ttl:
            del self._recent[scope]
            return None
        return stored

    async def aclose(self) -> None:
        self.close()

    async def _compute(self, scope: Scope, digest: str, compute: Callable[[], Awaitable[Answer]]) -> Answer:
        """The stored answer, else the request run here; repeats that arrive meanwhile wait."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._running[scope] = (digest, future)
        try:
            answer, kept = await self._once(scope, digest, compute)
        except BaseException:
            future.cancel()
            raise
        finally:
            del self._running[scope]
        if kept is not None:
            self._remember(scope, kept)
        future.set_result(answer)
        return answer

    async def _once(self, scope: Scope, digest: str,
                    compute: Callable[[], Awaitable[Answer]]) -> tuple[Answer, Stored | None]:
        """The answer stored on disk, else the request run here and its answer stored (a 200);
        with what to keep in memory (None: nothing)."""
        stored = await self._look_up(scope)
        if stored is not None:
            check(stored.fingerprint, digest, scope[1])
            return (stored.status, stored.body), stored
        answer = await compute()
        return answer, self.keep(scope, digest, answer)

    def keep(self, scope: Scope, digest: str, answer: Answer) -> Stored | None:
        """Write a 200 to disk; what to keep of ``answer`` in memory (None: not a 200)."""
        if answer[0] != 200:
            return None
        kept = Stored(digest, answer[0], answer[1], self._clock())
        self._writer.put(_INSERT, (*scope, kept.fingerprint, kept.status, kept.body, kept.stored_at))
        self._purge()
        return kept

    def _remember(self, scope: Scope, stored: Stored) -> None:
        self._recent[scope] = stored
        self._recent.move_to_end(scope)
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)

    def _purge(self) -> None:
        """At most once per :data:`PURGE_INTERVAL`: have the writer drop expired and surplus rows."""
        now = self._clock()
        if now - self._purged_at >= PURGE_INTERVAL:
            self._purged_at = now
            self._writer.put(_EXPIRE, (now - self.ttl,))
            self._writer.put(_OVERFLOW, (self.max_entries,))

    def _look_up(self, scope: Scope) -> asyncio.Future[Stored | None]:
        """The stored answer for ``scope`` from disk. Lookups made while a batch is on its way
        go together in the next one: one thread hop each way per batch, as the bridge does."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Stored | None] = loop.create_future()
        self._lookups.append((scope, future))
        if not self._looking:
            self._looking = True
            loop.call_soon(self._send_lookups, loop)  # the rest of this loop iteration's join it
        return future

    def _send_lookups(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._lookups = self._lookups, []
        self._reader.submit(self._select_all, batch, loop)

    def _select_all(self, batch: list[tuple[Scope, asyncio.Future[Stored | None]]],
                    loop: asyncio.AbstractEventLoop) -> None:
        """On the reader thread: every lookup of a batch, handed back in one hop."""
        results: list[tuple[asyncio.Future[Stored | None], Stored | None, sqlite3.Error | None]] = []
        for scope, future in batch:
            try:
                results.append((future, self._select(scope), None))
            except sqlite3.Error as exc:
                results.append((future, None, exc))
        loop.call_soon_threadsafe(self._deliver, results, loop)

    def _deliver(self, results: list, loop: asyncio.AbstractEventLoop) -> None:
        for future, stored, error in results:
            if future.done():
                continue  # its request was cancelled meanwhile
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(stored)
        self._looking = False
        if self._lookups:
            self._looking = True
            self._send_lookups(loop)

    def _open_reader(self, path: str) -> None:
        self._db = sqlite3.connect(path)

    def _select(self, scope: Scope) -> Stored | None:
        """On the reader thread: the unexpired answer stored for ``scope``, if any."""
        row = self._db.execute(_SELECT, scope).fetchone()
        if row is None or row[3] < self._clock() - self.ttl:
            return None
        return Stored(*row)


def check(stored: str, digest: str, idem_key: str) -> None:
    if stored != digest:
        raise KeyReused(f"Idempotency-Key: {idem_key!r} was already used with a different request body")
