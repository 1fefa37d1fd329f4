"""Usage records: one per finished request, written off the hot path, exactly once per id.

The server bills from its own count of tokens delivered. A handler only puts a record on a
queue; one writer thread drains it in batches into SQLite (:mod:`gateway.accounting.sqlite_writer`),
an append-only table keyed by request id (``INSERT OR IGNORE``: a record written twice stays one
row; a correction, ``replace=True``, replaces it). Every record is journaled before it is queued
(:mod:`gateway.accounting.journal`), so a killed gateway loses none, and ``close()`` flushes the
queue before it returns. API keys never reach the table: a record names the key by ``key_id``,
and the file is the gateway's user's alone (:mod:`gateway.accounting.private`).
"""

from __future__ import annotations

import dataclasses
import operator
import sqlite3
from collections.abc import Iterable

from gateway.accounting.private import private_database
from gateway.accounting.sqlite_writer import SqliteWriter

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id    TEXT PRIMARY KEY,
    recorded_at   REAL NOT NULL,
    tenant        TEXT NOT NULL,
    key_id        TEXT NOT NULL,
    model         TEXT NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    ttft_s        REAL,
    total_s       REAL NOT NULL,
    status        INTEGER NOT NULL,
    stop_reason   TEXT,
    outcome       TEXT,
    cached_tokens INTEGER,
    client_request_id TEXT
)
"""
_MIGRATIONS = {  # columns added since the first release
    "usage": {
        "outcome": "ALTER TABLE usage ADD COLUMN outcome TEXT",
        "cached_tokens": "ALTER TABLE usage ADD COLUMN cached_tokens INTEGER",
        "client_request_id": "ALTER TABLE usage ADD COLUMN client_request_id TEXT",
    }
}


@dataclasses.dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one finished request cost and how it went. Times in seconds."""

    request_id: str
    recorded_at: float
    tenant: str
    key_id: str
    model: str  # the resolved model version, not the alias the client sent
    input_tokens: int
    output_tokens: int  # delivered to the client, not merely generated
    ttft_s: float | None
    total_s: float
    status: int  # the HTTP status the client got
    stop_reason: str | None
    # what happened (gateway.accounting.ledger.Outcome); None in rows written before it existed
    outcome: str | None = None
    cached_tokens: int | None = 0  # of input_tokens, those the prefix cache supplied (None: older rows)
    client_request_id: str | None = None  # the client's X-Request-Id, when it sent a well-formed one


_FIELDS = [field.name for field in dataclasses.fields(UsageRecord)]
_ROW = operator.attrgetter(*_FIELDS)  # a record's values in column order (astuple deep-copies: slow)
_COLUMNS = f"INTO usage ({', '.join(_FIELDS)}) VALUES ({', '.join('?' * len(_FIELDS))})"
_INSERT = f"INSERT OR IGNORE {_COLUMNS}"
_REPLACE = f"INSERT OR REPLACE {_COLUMNS}"  # a correction, and the journal's replay (in order)


class UsageLog:
    """An append-only SQLite usage table fed by a queue and one writer thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._writer = SqliteWriter(private_database(path), _SCHEMA, "usage-writer", _MIGRATIONS, _REPLACE)

    def record(self, record: UsageRecord, replace: bool = False) -> None:
        """Journal and queue a record; returns at once (the caller is serving a request). With
        ``replace`` it takes the place of the row of the same id."""
        self._writer.put(_REPLACE if replace else _INSERT, _ROW(record))

    def close(self) -> None:
        """Write everything queued, then stop the writer."""
        self._writer.close()


def read_usage(path: str) -> list[UsageRecord]:
    """Every record in a usage table, oldest first."""
    connection = sqlite3.connect(path)
    try:
        rows: Iterable[tuple] = connection.execute(
            f"SELECT {', '.join(_FIELDS)} FROM usage ORDER BY recorded_at"
        )
        return [UsageRecord(*row) for row in rows]
    finally:
        connection.close()
