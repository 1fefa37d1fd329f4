"""Connections a hostile client cannot hold: a header deadline, a body deadline, an idle
deadline, and a cap that makes room by closing the connections that do nothing.

aiohttp gives the idle deadline but no header or body deadline and no cap, so each accepted
connection is wrapped in a :class:`_Connection` that knows its phase::

    accept ──> AWAITING: its headers due within header_timeout
               ──the handler starts──> BUSY: its body due within body_timeout (408)
               ──the handler ends──> IDLE: keep-alive until idle_timeout ──a byte──> AWAITING

At the cap, a new connection closes the oldest IDLE one, else the oldest slow AWAITING one, and
is refused (503) only when every connection runs a request. Counts: :class:`ConnectionCollector`."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Protocol, cast

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.accounting.auth import Principal
from gateway.wire import api
from gateway.wire.errors import error_shape

SWEEP = 0.25  # seconds between sweeps for late headers, at most: a header deadline is kept within it
SLOW_AFTER = 1.0  # seconds a connection may take over its headers before the cap may close it for room
REFUSAL_LINGER = 1.0  # seconds a refused connection may stay open for the client to read its 503
MAX_LINGERING = 256  # refused connections lingering at once; more are closed right after the 503


class Phase(enum.StrEnum):
    """A connection's phase. A ``str`` enum: it keys the guard's dicts several times a request,
    and a plain Enum's hash is a Python call (``str``'s is not)."""

    AWAITING = "awaiting"  # waiting for a request's headers
    BUSY = "busy"  # a request's handler runs
    IDLE = "idle"  # keep-alive, nothing received since the last answer
    CLOSED = "closed"  # closed by the guard or the peer; no longer counted


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The request's body, or :class:`~gateway.wire.api.RequestTimeout` (408) if it is not all here
    within ``timeout`` seconds. aiohttp then closes the connection: its unread rest cannot frame a
    next request.

    aiohttp inflates a ``Content-Encoding: gzip`` or ``deflate`` body a bounded chunk at a time,
    and ``client_max_size`` counts the inflated bytes, so a zip bomb gets its 413 at
    ``max_body_bytes``. A body that does not decode as its header says is
    :class:`~gateway.wire.api.UnreadableBody` (400), and the connection closes after the answer."""
    try:
        if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
            return await request.read()
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise api.RequestTimeout(
            f"body: not received within {timeout * 1000:.0f} ms of the headers"
        ) from None
    except web.RequestPayloadError as exc:
        request.content.feed_eof()  # the parser stops at a body it cannot read: nothing more will come
        raise api.UnreadableBody(_unreadable(request, exc)) from None


def _unreadable(request: web.Request, error: web.RequestPayloadError) -> str:
    """What was wrong with a body aiohttp could not read, in words that quote nothing of it."""
    if isinstance(error.__cause__, ContentEncodingError):
        encoding = request.headers.get("Content-Encoding", "")[:40]
        return f"body: not valid {encoding!r} data, as its Content-Encoding header declares"
    return "body: its framing is broken (a chunked or Content-Length body cut short or malformed)"


class Keys(Protocol):
    """The keys a request is checked against (a :class:`~gateway.accounting.auth.KeyRing`)."""

    def authenticate(self, headers: Mapping[str, str]) -> Principal: ...


def key_before_body(keys: Keys, max_body_bytes: int) -> ExpectHandler:
    """A route's ``expect_handler``: a client that sends ``Expect: 100-continue`` waits for
    the word before sending its body, so the key and the declared size are checked first: an
    unknown key gets its 401 and a ``Content-Length`` over ``max_body_bytes`` its 413 (and the
    connection closes), neither body ever sent (aiohttp's own handler says ``100 Continue`` to
    anyone, and a body too large met its 413 only once uploaded)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        try:
            keys.authenticate(request.headers)
        except api.AuthenticationFailed as exc:
            return _json_error(request, exc)
        if request.content_length is not None and request.content_length > max_body_bytes:
            refusal = _json_error(request, api.body_too_large(max_body_bytes))
            refusal.force_close()  # the body the header announced will not come: nothing can follow it
            return refusal
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            unknown = api.InvalidRequest(f"Expect: only 100-continue is understood, got {expect[:40]!r}")
            return _json_error(request, unknown, 417)
        transport = request.transport  # None once the client has gone: then nothing to tell it
        if request.version >= (1, 1) and transport is not None:  # HTTP/1.0 has no interim answers
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    return expect


def _json_error(request: web.Request, error: BaseException, status: int | None = None) -> web.Response:
    code, body, headers = error_shape(request).error_response(error)
    return web.Response(status=status or code, body=body, headers=headers, content_type="application/json")


class ConnectionGuard:
    """Every connection's phase and deadlines, the cap, and the counts /metrics shows."""

    def __init__(self, cap: int, header_timeout: float) -> None:
        self.cap = cap
        self.header_timeout = header_timeout
        self._phases: dict[Phase, dict[_Connection, None]] = {
            phase: {} for phase in Phase if phase is not Phase.CLOSED
        }
        self._by_handler: dict[asyncio.Protocol, _Connection] = {}
        self._lingering = 0
        self._drained: asyncio.Future[None] | None = None  # while drained() waits for BUSY to empty
        self.closed = {"header_timeout": 0, "evicted": 0, "refused": 0, "body_timeout": 0}
        self._sweep: asyncio.TimerHandle | None = None  # the next sweep for late headers, while any are due
        self._sweep_every = min(SWEEP, header_timeout / 4)

    def accept(self, make_handler: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
        """The protocol for a connection just accepted (the listening server's factory)."""
        if len(self._by_handler) >= self.cap and not self._evict():
            self.closed["refused"] += 1
            return _Refusal(self, linger=self._lingering < MAX_LINGERING)
        connection = _Connection(self, make_handler())
        self._by_handler[connection.inner] = connection
        self._phases[Phase.AWAITING][connection] = None
        self._arm(connection)
        return connection

    @web.middleware
    async def track(self, request: web.Request, handler) -> web.StreamResponse:
        """The request's connection is BUSY while its handler runs, IDLE after."""
        connection = self._by_handler.get(request.protocol)
        if connection is not None:  # None: closed by the guard while its request was parsed
            self._enter(connection, Phase.BUSY)
        try:
            return await handler(request)
        except api.RequestTimeout:
            self.closed["body_timeout"] += 1
            raise
        finally:
            if connection is not None and connection.phase is Phase.BUSY:
                self._enter(connection, Phase.IDLE)

    async def drained(self, timeout: float) -> bool:
        """Wait until no connection runs a request, for ``timeout`` seconds at most: True if so."""
        if not self._phases[Phase.BUSY]:
            return True
        self._drained = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._drained
        except TimeoutError:
            return False
        finally:
            self._drained = None
        return True

    def counts(self) -> dict[str, int]:
        """Open connections by phase."""
        return {phase.value: len(members) for phase, members in self._phases.items()}

    def _enter(self, connection: _Connection, phase: Phase) -> None:
        """Move an open connection to ``phase`` (the newest of it); CLOSED forgets it. Runs
        three times a request: kept to dict moves and attribute reads."""
        phases = self._phases
        left = connection.phase
        del phases[left][connection]
        connection.phase = phase
        if phase is Phase.CLOSED:
            del self._by_handler[connection.inner]
        else:
            phases[phase][connection] = None  # dicts keep insertion order: oldest first
            if phase is Phase.AWAITING:
                self._arm(connection)
        if (
            left is Phase.BUSY
            and self._drained is not None
            and not phases[Phase.BUSY]
            and not self._drained.done()
        ):
            self._drained.set_result(None)

    def _arm(self, connection: _Connection) -> None:
        """Its headers are due from now: one sweep a fraction of the header timeout apart closes
        the late ones, rather than a timer made and cancelled for every request."""
        loop = asyncio.get_running_loop()
        connection.since = loop.time()
        if self._sweep is None:
            self._arm_sweep()

    def _expire(self) -> None:
        """Close the connections whose headers are late (no request to answer). AWAITING keeps
        them in the order they entered it, so the sweep stops at the first one still in time."""
        self._sweep = None
        awaiting = self._phases[Phase.AWAITING]
        limit = asyncio.get_running_loop().time() - self.header_timeout
        for connection in list(awaiting):
            if connection.since > limit:
                break
            self.closed["header_timeout"] += 1
            self._close(connection)
        if awaiting:
            self._arm_sweep()

    def _arm_sweep(self) -> None:
        self._sweep = asyncio.get_running_loop().call_later(self._sweep_every, self._expire)

    def _evict(self) -> bool:
        """Close the oldest IDLE connection, else the oldest AWAITING one if it has been sending
        its headers for :data:`SLOW_AFTER` (a younger one may be a client whose request is on
        its way); False if there is neither."""
        victim = next(iter(self._phases[Phase.IDLE]), None)
        if victim is None:
            victim = next(iter(self._phases[Phase.AWAITING]), None)
            if victim is None or asyncio.get_running_loop().time() - victim.since < SLOW_AFTER:
                return False
        self.closed["evicted"] += 1
        self._close(victim)
        return True

    def _close(self, connection: _Connection) -> None:
        transport = connection.transport
        assert transport is not None, "closed before it was made"  # deadlines and eviction wait longer
        self._enter(connection, Phase.CLOSED)
        transport.close()


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, passed every event, and its phase beside it."""

    __slots__ = ("guard", "inner", "phase", "since", "transport")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.BaseTransport | None = None
        self.phase = Phase.AWAITING  # a new connection's first request is due
        self.since = 0.0  # loop time it entered AWAITING

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.IDLE:  # the first byte of the next request: its headers are due
            self.guard._enter(self, Phase.AWAITING)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase is not Phase.CLOSED:
            self.guard._enter(self, Phase.CLOSED)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Refusal(asyncio.Protocol):
    """A connection over the cap: a 503 in the JSON error shape, then a clean close (the
    client's request is read and dropped for a moment, so that no reset destroys the answer)."""

    def __init__(self, guard: ConnectionGuard, linger: bool) -> None:
        self.guard = guard
        self.linger = linger
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's transport writes (uvloop's is no asyncio.WriteTransport: no isinstance)
        stream = cast(asyncio.WriteTransport, transport)
        kind = api.ErrorKind(503, "overloaded_error")
        body = api.dumps(api.error_body(kind, f"the gateway holds its limit of {self.guard.cap} connections"))
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        stream.write(head.encode() + body)
        if not self.linger:
            stream.close()
            return
        self.guard._lingering += 1
        stream.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER, stream.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request of a connection that was refused: dropped

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.guard._lingering -= 1


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, with every accepted connection passed through a :class:`ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *, backlog: int
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        make_handler = self._runner.server
        assert make_handler is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.accept(make_handler), self._host, self._port, backlog=self._backlog
        )


class ConnectionCollector(Collector):
    """``ferry_connections`` {phase} and ``ferry_connections_closed_total`` {reason}."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator:
        open_ = GaugeMetricFamily("ferry_connections", "Open client connections, by phase.", labels=["phase"])
        for phase, count in self.guard.counts().items():
            open_.add_metric([phase], count)
        closed = CounterMetricFamily(
            "ferry_connections_closed",
            "Connections the gateway closed or refused, by reason.",
            labels=["reason"],
        )
        for reason, count in self.guard.closed.items():
            closed.add_metric([reason], count)
        yield open_
        yield closed
