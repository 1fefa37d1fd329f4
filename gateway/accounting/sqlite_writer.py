"""One thread that owns a SQLite connection and applies the writes handlers put on its queue.

A request handler runs on the asyncio thread, where a synchronous SQLite write (a disk sync per
commit) would stall every other request. So handlers only ``put`` a statement and its row (no
I/O, no lock held across a write), and the writer thread drains the queue in batches: one
transaction per batch, consecutive rows of one statement in one ``executemany``. ``close()``
applies what is queued before it returns. The usage log and the idempotency store both write
through one of these. Given a :class:`~gateway.accounting.journal.Journal`, every write is also appended to
it before it is queued, and a commit deletes the journal's segment it covered: then a write
survives the process being killed at any moment, and the next start replays it.
"""

from __future__ import annotations

import itertools
import pathlib
import queue
import sqlite3
import threading
import time
from collections.abc import Mapping

from gateway.accounting.journal import Journal

FLUSH_INTERVAL = 0.05  # seconds a write may wait for the next commit
_STOP = object()


class SqliteWriter:
    """A queue of ``(statement, row)`` writes and the thread that commits them, in order."""

    def __init__(self, path: str, schema: str, name: str, migrations: Mapping[str, Mapping[str, str]] = {},
                 replay: str | None = None) -> None:
        """Open ``path``: bring its tables up to date (``migrations``: per table, the statement
        that adds each column a table from an older release lacks), then run ``schema``. With a
        ``replay`` statement every write is journaled first (its row must suit ``replay``), and
        the rows a killed process left in the journal are applied with it now (a row an older
        release journaled, short of the columns added since, has them NULL)."""
        self.path = path
        connection = sqlite3.connect(path)  # create the tables now: a bad path fails at start-up
        connection.execute("PRAGMA journal_mode=WAL")  # kept by the file: readers never wait for the writer
        with connection:
            for table, added in migrations.items():
                columns = {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}
                for column, statement in added.items():
                    if columns and column not in columns:
                        connection.execute(statement)
            connection.executescript(schema)
        self._journal = None if replay is None else Journal(path)
        if self._journal is not None and replay is not None:  # one with the other
            with connection:
                width = replay.count("?")
                for segment in self._journal.leftovers:
                    rows = Journal.rows(segment)
                    connection.executemany(replay, (row + (None,) * (width - len(row)) for row in rows))
            for segment in self._journal.leftovers:
                segment.unlink()
        connection.close()
        self._lock = threading.Lock()  # a write's append and its place in the queue, against a rotation
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, statement: str, row: tuple) -> None:
        """Queue one write (journaled first, if this writer journals); returns at once."""
        if self._journal is None:
            self._queue.put((statement, row))
            return
        with self._lock:
            self._journal.append(row)
            self._queue.put((statement, row))

    def close(self) -> None:
        """Commit everything queued, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join()
        if self._journal is not None:
            self._journal.close()

    def _take(self, batch: list[object]) -> pathlib.Path | None:
        """Add what is queued to ``batch``; with a journal, rotate it in the same step: the
        finished segment (to delete once the batch is committed)."""
        with self._lock:
            while not self._queue.empty():
                batch.append(self._queue.get())
            return None if self._journal is None else self._journal.rotate()

    def _write(self) -> None:
        connection = sqlite3.connect(self.path)
        connection.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no committed row
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            if batch[0] is not _STOP:
                time.sleep(FLUSH_INTERVAL)  # let a batch gather: one commit, not one per request
            finished = self._take(batch)
            stopping = any(item is _STOP for item in batch)
            writes = [item for item in batch if isinstance(item, tuple)]  # (statement, row): all but _STOP
            with connection:
                by_statement = itertools.groupby(writes, key=lambda write: write[0])
                for statement, group in by_statement:
                    connection.executemany(statement, [row for _, row in group])
            if finished is not None:
                finished.unlink()
        connection.close()
