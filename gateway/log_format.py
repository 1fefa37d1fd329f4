"""How the gateway's log lines are written: ``text`` (``time logger LEVEL message``) or ``json``,
one object a line (``ferry serve --log-format json``) for a log pipeline to index:

    {"time": "2026-12-04T10:21:07.412Z", "level": "INFO", "logger": "ferry.access",
     "message": "...", "request_id": "msg_1a2b_17", ...}

A line written while a request is served carries its ``request_id`` (:data:`REQUEST`, which the
access log sets for the request's task); a record's ``fields`` (the access log's) are merged in.
An exception is its type and message, and the traceback under ``traceback``."""

from __future__ import annotations

import contextvars
import datetime
import logging

import msgspec

REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_ENCODER = msgspec.json.Encoder()


class JsonLines(logging.Formatter):
    """One JSON object per record (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, object] = {
            "time": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request = REQUEST.get()
        if request is not None:
            line["request_id"] = request
        line.update(getattr(record, "fields", {}))
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line["error"] = f"{type(error).__name__}: {error}"
            line["traceback"] = self.formatException(record.exc_info)
        return _ENCODER.encode(line).decode()


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """Write every logger's lines to stderr in ``log_format`` (replacing the root's handlers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
