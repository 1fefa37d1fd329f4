"""The frames a worker process and its pool exchange, and the codec for them.

Theory of operation (sans-IO, after h11): a frame is a 4-byte big-endian length followed by that
many bytes of one msgpack map. The map names its message in the field ``kind``; the other fields
are the message's own. This module turns messages into bytes (:func:`encode`) and bytes into
messages (:class:`FrameDecoder`), and does no I/O: the worker feeds it what it reads from a pipe,
the pool feeds it what trio reads from the same pipe, and the tests feed it one byte at a time.

A frame whose declared length exceeds the limit is refused as soon as its 4-byte header arrives,
before its body is buffered, so a confused or hostile peer cannot make the other side allocate
gigabytes. Anything that is not a map of a known kind with fields of the right types is a
:class:`ProtocolError`: the pool treats it like a crash (kill, restart, retry the batch).

Fixed mode::

    worker -> pool   ready   {pid, model}                 once, after the model has loaded
    pool -> worker   run_batch {id, inputs: [str]}
    worker -> pool   accepted {id}                        at once, before the model runs
    worker -> pool   result  {id, outputs: [str]}         one output per input, in order
    worker -> pool   error   {id, message}                the call failed; the worker lives on

``accepted`` tells the pool that the call reached a live worker: a worker that dies before
accepting a call (its pipe closes first) died of something else, so the call is not held
against its inputs (:class:`NotDelivered`).

This is the only module that ``batcher`` and ``workers`` share.
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from typing import ClassVar

import msgpack

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest frame body either side accepts: 50 inputs of a 1 MB prompt each fit with room."""

_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame broke the protocol: too large, not msgpack, not a map, unknown kind, bad fields."""


class WorkerLost(Exception):
    """The worker's end of the pipe closed: it exited, crashed or was killed."""


class NotDelivered(WorkerLost):
    """The worker was gone before it accepted a call (its pipe closed on send, or before the
    ``accepted`` frame): the call cannot have caused its death, so it does not count against
    the call's inputs."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """The worker has loaded its model and takes calls from now on."""

    kind: ClassVar[str] = "ready"
    pid: int
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class RunBatch:
    """Run the model on ``inputs`` (1..max_batch strings) and answer with the same ``id``."""

    kind: ClassVar[str] = "run_batch"
    id: int
    inputs: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """The worker has read call ``id`` and is running it; its answer follows."""

    kind: ClassVar[str] = "accepted"
    id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """The outputs of call ``id``, one per input, in the inputs' order."""

    kind: ClassVar[str] = "result"
    id: int
    outputs: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Error:
    """Call ``id`` failed inside the model; the worker is still able to take the next call."""

    kind: ClassVar[str] = "error"
    id: int
    message: str


Message = Ready | RunBatch | Accepted | Result | Error
_KINDS: dict[str, type] = {cls.kind: cls for cls in typing.get_args(Message)}


def _check(value: object, hint: object) -> bool:
    """True when a decoded msgpack value matches a field's annotation (int, str, list[X])."""
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return type(value) is str
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return type(value) is list and all(_check(v, item) for v in value)
    raise TypeError(f"protocol field annotation not supported: {hint!r}")


def _field_hints(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


_FIELDS = {kind: _field_hints(cls) for kind, cls in _KINDS.items()}


def encode(message: Message, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: the 4-byte length and the msgpack map of ``message``."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    body = msgpack.packb({"kind": message.kind, **fields}, use_bin_type=True)
    if len(body) > max_frame:
        raise ProtocolError(f"{message.kind} frame of {len(body)} bytes exceeds {max_frame}")
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Message:
    """The message in one frame body, or :class:`ProtocolError` saying what is wrong with it."""
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"frame is not msgpack: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"frame is a {type(fields).__name__}, not a map")
    kind = fields.pop("kind", None)
    hints = _FIELDS.get(kind) if isinstance(kind, str) else None
    if hints is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if fields.keys() != hints.keys():
        raise ProtocolError(f"{kind} has fields {sorted(fields)}, expected {sorted(hints)}")
    for name, hint in hints.items():
        if not _check(fields[name], hint):
            raise ProtocolError(f"{kind}.{name} is not a {hint}")
    return _KINDS[kind](**fields)


class FrameDecoder:
    """Incremental decoder: feed it bytes in any pieces, get whole messages back in order.

    >>> decoder = FrameDecoder()
    >>> frame = encode(Error(id=7, message="boom"))
    >>> decoder.feed(frame[:3]), decoder.feed(frame[3:])
    ([], [Error(id=7, message='boom')])
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._max_frame = max_frame
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data`` and return every message it completes (possibly none)."""
        buffer = self._buffer
        buffer += data
        messages = []
        while len(buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer)
            if length > self._max_frame:
                raise ProtocolError(f"frame of {length} bytes exceeds {self._max_frame}")
            end = _HEADER.size + length
            if len(buffer) < end:
                break
            body = bytes(buffer[_HEADER.size : end])
            del buffer[:end]
            messages.append(decode_body(body))
        return messages
