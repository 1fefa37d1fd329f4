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

Continuous mode (``python -m workers engine``; a step is one forward pass)::

    worker -> pool   ready   {pid, model}
    pool -> worker   add     {rid, prompt_tokens, max_tokens, tier, tenant, temperature, top_p,
                              top_k, seed (nil: unseeded), stop_token_ids, ignore_eos}
    pool -> worker   abort   {rid}                        an unknown rid is ignored
    worker -> pool   tokens  {rid, ids}                   each step's tokens, one frame per rid,
                                                          all of a step's frames in one write
    worker -> pool   finished {rid, reason, usage: {prompt_tokens, cached_tokens, output_tokens}}
    worker -> pool   stats   {step, running, waiting, queued_tokens, free_blocks, used_blocks,
                              total_blocks, cached_blocks, preemptions, prefix_queries,
                              prefix_hits, computed_tokens, generated_tokens}   every ~200 ms

A rid's last ``tokens`` frame precedes its ``finished`` frame. For ``eos`` and ``stop_token`` the
stop token itself is not sent (it is not text): ``finished``'s ``output_tokens`` counts it, so
that count is one more than the ids sent.

This is the only module that ``batcher`` and ``workers`` share.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from typing import ClassVar, Literal

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


@dataclasses.dataclass(frozen=True, slots=True)
class Add:
    """Queue sequence ``rid`` (the pool's number, unique among the worker's live sequences)."""

    kind: ClassVar[str] = "add"
    rid: int
    prompt_tokens: list[int]
    max_tokens: int
    tier: int
    tenant: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Drop sequence ``rid`` (its client went away); a ``finished`` frame says ``aborted``."""

    kind: ClassVar[str] = "abort"
    rid: int


@dataclasses.dataclass(frozen=True, slots=True)
class Tokens:
    """The tokens sequence ``rid`` generated in one step, in order."""

    kind: ClassVar[str] = "tokens"
    rid: int
    ids: list[int]


FinishReasonName = Literal["eos", "stop_token", "max_tokens", "aborted", "too_long"]


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """A finished sequence's tokens: its prompt, the part of it the prefix cache supplied, its output."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """Sequence ``rid`` ended; no frame names it afterwards."""

    kind: ClassVar[str] = "finished"
    rid: int
    reason: FinishReasonName
    usage: Usage


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """The engine's load (gauges) and its counters since it started, in blocks and tokens."""

    kind: ClassVar[str] = "stats"
    step: int
    running: int
    waiting: int
    queued_tokens: int
    free_blocks: int
    used_blocks: int
    total_blocks: int
    cached_blocks: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    computed_tokens: int
    generated_tokens: int


Message = Ready | RunBatch | Accepted | Result | Error | Add | Abort | Tokens | Finished | Stats
_KINDS: dict[str, type] = {cls.kind: cls for cls in typing.get_args(Message)}


def _check(value: object, hint: object) -> bool:
    """True when a decoded msgpack value matches a field's annotation: int, float, str, bool,
    list[X], X | None, a Literal of strings, or a dataclass (a map of exactly its fields)."""
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return type(value) is str
    if hint is bool:
        return type(value) is bool
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return type(value) is list and all(_check(v, item) for v in value)
    if origin is types.UnionType:
        return any(_check(value, option) for option in typing.get_args(hint))
    if origin is Literal:
        return type(value) is str and value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if dataclasses.is_dataclass(hint):
        fields = _field_hints(hint)
        if type(value) is not dict or value.keys() != fields.keys():
            return False
        return all(_check(value[name], field) for name, field in fields.items())
    raise TypeError(f"protocol field annotation not supported: {hint!r}")


def _field_hints(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


_FIELDS = {kind: _field_hints(cls) for kind, cls in _KINDS.items()}


def _to_map(value: object) -> dict[str, object]:
    """A message (or a dataclass inside one) as a map; lists go out as they are, uncopied."""
    return {
        f.name: _to_map(v) if dataclasses.is_dataclass(v := getattr(value, f.name)) else v
        for f in dataclasses.fields(value)
    }


def encode(message: Message, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: the 4-byte length and the msgpack map of ``message``."""
    body = msgpack.packb({"kind": message.kind, **_to_map(message)}, use_bin_type=True)
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
        if dataclasses.is_dataclass(hint):
            fields[name] = hint(**fields[name])
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
