"""Rows written ahead of a SQLite table: what makes a usage record survive a SIGKILL.

A queued row reaches the database at the writer's next commit; a process killed meanwhile would
lose it, though its client had the answer. So each row is first appended to a journal segment
(``<database>.ahead.<n>``): one ``write`` of one JSON line, in the kernel's page cache once the
call returns, which outlives the process (not the machine)::

    put:     append the row to segment n, then queue it        (under one lock)
    commit:  rotate to segment n+1 and take the queue; commit what was taken; delete segment n
    start:   replay the segments a killed process left, in order, then delete them

Replay uses the table's "replace" statement in put order; a last line cut short is skipped."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator

import msgspec

from gateway.accounting.private import FILE_MODE

_ENCODE = msgspec.json.Encoder().encode  # a row's JSON array, compact, UTF-8


class Journal:
    """The current segment to append to, and the segments left by a process that did not close."""

    def __init__(self, database: str) -> None:
        self._base = pathlib.Path(database + ".ahead")
        self.leftovers = sorted(self._segments(), key=self._number)
        self._next = max((self._number(path) for path in self.leftovers), default=0) + 1
        self._fd = self._open()

    def append(self, row: tuple) -> None:
        """Write one row; it outlives this process once this returns. Encoded by msgspec (a
        fifth of the standard library's time, once a request); read back by :meth:`rows`."""
        os.write(self._fd, _ENCODE(row) + b"\n")

    def rotate(self) -> pathlib.Path:
        """Append to a new segment from now on; the finished one's path (delete it once its
        rows are committed)."""
        finished = self._path(self._next - 1)
        os.close(self._fd)
        self._fd = self._open()
        return finished

    def close(self) -> None:
        """Stop appending; the current segment is dropped (call once its rows are committed).
        Closing again does nothing."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._path(self._next - 1).unlink(missing_ok=True)

    @staticmethod
    def rows(segment: pathlib.Path) -> Iterator[tuple]:
        """The rows of a segment, in the order they were appended."""
        for line in segment.read_bytes().split(b"\n"):
            try:
                yield tuple(json.loads(line))
            except ValueError:
                continue  # the empty tail, or a line a crash cut short

    def _open(self) -> int:
        path = self._path(self._next)
        self._next += 1
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)

    def _path(self, number: int) -> pathlib.Path:
        return self._base.with_name(f"{self._base.name}.{number}")

    def _segments(self) -> Iterator[pathlib.Path]:
        for path in self._base.parent.glob(self._base.name + ".*"):
            if path.suffix[1:].isdigit():
                yield path

    @staticmethod
    def _number(path: pathlib.Path) -> int:
        return int(path.suffix[1:])
