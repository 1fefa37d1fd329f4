"""Log lines a hostile client can neither fill with its bytes nor flood.

aiohttp logs a request its parser refuses at ERROR, with a traceback whose message quotes the
offending bytes: a header line with its API key (``b'x-api-key: sk-...'``), or the whole body
of an HTTP/1.0 request sent after its headers. :class:`NoRequestBytes` rewrites such a record
into one line: the peer and what was wrong (``Invalid header value char``), never the bytes,
at WARNING (it is the client's fault), and at most :data:`BURST` lines per :data:`INTERVAL`
seconds, the rest counted into the next line that is written.

:class:`Throttle` is the rate bound; the Redis limiter uses it too, so an outage writes a line
per interval, not one per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

INTERVAL = 10.0  # seconds
BURST = 10  # lines about bad requests per interval; the rest are counted
AIOHTTP_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access")
_QUOTES = (" b'", ' b"', " '", ' "')


class Throttle:
    """At most ``burst`` events per ``interval`` pass; the others are counted, and the next one
    that passes carries the count of those suppressed since the last."""

    def __init__(
        self, interval: float = INTERVAL, burst: int = 1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._window_start = -float("inf")
        self._passed = 0
        self.suppressed = 0  # since the last event that passed

    def admit(self) -> int | None:
        """None: suppress this event. Otherwise let it pass and return how many were suppressed
        before it (and reset that count)."""
        now = self._clock()
        if now - self._window_start >= self.interval:
            self._window_start, self._passed = now, 0
        if self._passed >= self.burst:
            self.suppressed += 1
            return None
        self._passed += 1
        suppressed, self.suppressed = self.suppressed, 0
        return suppressed


def describe(error: HttpProcessingError) -> str:
    """What a parser error says was wrong, without the bytes it quotes: its first line, cut
    before the first quoted value (``Got more than 8190 bytes when reading``)."""
    text = error.message.split("\n", 1)[0]
    for quote in _QUOTES:
        text = text.split(quote, 1)[0]
    return text.rstrip(": ")[:120] or type(error).__name__


class NoRequestBytes(logging.Filter):
    """Rewrite aiohttp's records about refused requests: one line, no bytes, rate-bounded."""

    def __init__(self, throttle: Throttle | None = None) -> None:
        super().__init__()
        self.throttle = throttle or Throttle(burst=BURST)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        suppressed = self.throttle.admit()
        if suppressed is None:
            return False
        more = f" ({suppressed} more bad requests not logged)" if suppressed else ""
        record.msg, record.args = "%s: %s (%s)%s", (record.getMessage(), describe(error), error.code, more)
        record.exc_info = record.exc_text = record.stack_info = None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def hide_request_bytes() -> None:
    """Install :class:`NoRequestBytes` on aiohttp's loggers (once, whoever calls it again)."""
    guard = NoRequestBytes()
    for name in AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoRequestBytes) for f in logger.filters):
            logger.addFilter(guard)
