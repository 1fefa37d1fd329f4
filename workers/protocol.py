"""The frames a worker process and its pool exchange, and the codec for them.

Theory of operation (sans-IO, after h11): a frame is a 4-byte big-endian length followed by that
many bytes of one msgpack map. The map names its message in the field ``kind``; the other fields
are the message's own. This module turns messages into bytes (:func:`encode`) and bytes into
messages (:class:`FrameDecoder`), and does no I/O: the worker feeds it what it reads from a pipe,
the pool feeds it what trio reads from the same pipe, and the tests feed it one byte at a time.

A frame whose declared length exceeds the limit is refused as soon as its 4-byte header arrives,
before its body is buffered, so a confused or hostile peer cannot make the other side allocate
gigabytes. Anything that is not a map of a known kind with exactly its fields, each of the right
type, is a :class:`ProtocolError` naming the bad field (``add.seed``): the pool treats it like a
crash (kill, restart, retry the batch). Each message is a msgspec struct tagged by its kind, so
one typed decoder checks every field strictly (no int for a str, no bool for an int) in C.

Fixed mode::

    worker -> pool   ready   {pid, model}                 once, after the model has loaded
    worker -> pool   unloadable {message}                 instead: the model could not be built
    pool -> worker   run_batch {id, inputs: [str]}        may come while the call before it runs
    pool -> worker   skip    {id, positions: [int]}       inputs of a call not yet started whose
                                                          callers have gone: left out of it
    worker -> pool   accepted {id, skipped: [int]}        as the call starts, before the model runs,
                                                          with the positions it left out
    worker -> pool   result  {id, outputs: [str], vectors: [bin]}   one output per input, in order:
                                                          texts, or (outputs empty) vectors of packed
                                                          float32, little-endian
    worker -> pool   error   {id, message}                the call failed; the worker lives on

``accepted`` tells the pool that the call reached a live worker: a worker that dies before
accepting a call (its pipe closes first) died of something else, so the call is not held
against its inputs (:class:`NotDelivered`). The pool may send a call while the one before it
runs, so that it waits in the pipe and starts the moment the other ends; the worker reads what
else has arrived before it starts a call, and leaves out the positions a ``skip`` names (a
``skip`` that comes too late is ignored, and the pool drops those outputs).

Continuous mode (``python -m workers engine``; a step is one forward pass)::

    worker -> pool   ready   {pid, model}
    pool -> worker   add     {rid, prompt_tokens, max_tokens, tier, tenant, temperature, top_p,
                              top_k, seed (nil: unseeded), stop_token_ids, ignore_eos,
                              presence_penalty, frequency_penalty, repetition_penalty, min_p,
                              logit_bias: [[id, bias]]}   the last five optional (neutral)
    pool -> worker   abort   {rid}                        an unknown rid is ignored
    worker -> pool   tokens  {rid, ids}                   each step's tokens, one frame per rid,
                                                          all of a step's frames in one write
    worker -> pool   finished {rid, reason, usage: {prompt_tokens, cached_tokens, output_tokens}}
    worker -> pool   stats   {step, running, waiting, free_blocks, used_blocks, total_blocks,
                              cached_blocks, preemptions, prefix_queries, prefix_hits,
                              computed_tokens, generated_tokens}   every ~200 ms
    worker -> pool   step    {seconds}                    as a step starts that it expects to take
                                                          longer than that: how long (inf: it has
                                                          measured no step to tell by)

Prefill and decode on separate engines (the KV hand-off, ``workers/engine/kv_transfer.py``)::

    worker -> pool   kv      {rid, data}                  whole KV blocks of a sequence, in order
    worker -> pool   kv_exported {rid, manifest, seconds} after its first token: it left this engine
    pool -> worker   kv      {rid, data}                  the same bytes, forwarded to a decode engine
    pool -> worker   kv_handoff {add, manifest}           run ``add`` over the KV just sent
    worker -> pool   kv_taken {rid, seconds, stepped}     with the frames of the step after the
                                                          import: it took ``seconds``, and the
                                                          step ``stepped`` more (the pause's parts)

A manifest (``kv_tokens, blocks, block_bytes, digest, cached_tokens, segment``) lets the receiving
engine check the bytes by count and hash before it uses them; ``segment`` names the shared-memory
file that holds them instead of ``kv`` frames (engines on one host).

A rid's last ``tokens`` frame precedes its ``finished`` frame. For ``eos`` and ``stop_token`` the
stop token itself is not sent (it is not text): ``finished``'s ``output_tokens`` counts it, so
that count is one more than the ids sent.
"""

from __future__ import annotations

import struct
import typing
from typing import Annotated, ClassVar, Literal

import msgspec

from workers.kv_manifest import KvManifest as KvManifest
from workers.protocol_errors import ModelUnloadable as ModelUnloadable
from workers.protocol_errors import NotDelivered as NotDelivered
from workers.protocol_errors import ProtocolError as ProtocolError
from workers.protocol_errors import WorkerLost as WorkerLost
from workers.sampling import Sampling

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest frame body either side accepts: 50 inputs of a 1 MB prompt each fit with room."""

_HEADER = struct.Struct(">I")


class Frame(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """A message on the pipe: a map whose ``kind`` field is its class's tag, and exactly its
    fields, each of its declared type (msgspec checks them as it decodes)."""

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)  # every frame's tag is a str


class Ready(Frame, tag="ready", frozen=True):
    """The worker has loaded its model and takes calls from now on."""

    pid: int
    model: str


class Unloadable(Frame, tag="unloadable", frozen=True):
    """The worker could not import or build its model (``message``: the exception's type and
    message, never its traceback, which the worker logs); it exits after this frame."""

    message: str


class RunBatch(Frame, tag="run_batch", frozen=True):
    """Run the model on ``inputs`` (1..max_batch strings) and answer with the same ``id``."""

    id: int
    inputs: list[str]


class Skip(Frame, tag="skip", frozen=True):
    """Leave the inputs at ``positions`` out of call ``id``, if it has not started: their
    callers have gone."""

    id: int
    positions: list[int]


class Accepted(Frame, tag="accepted", frozen=True):
    """The worker has read call ``id`` and is running it, without the inputs at the positions
    ``skipped``; its answer (one output per input run) follows."""

    id: int
    skipped: list[int] = []


class Result(Frame, tag="result", frozen=True):
    """The outputs of call ``id``, one per input, in the inputs' order: texts in ``outputs``, or
    (an embedding model's) vectors of float32 values packed little-endian in ``vectors``."""

    id: int
    outputs: list[str]
    vectors: list[bytes] = []

    @property
    def answers(self) -> list[str] | list[bytes]:
        """The outputs, whichever kind they are (a worker never sends both)."""
        return self.vectors or self.outputs


class Error(Frame, tag="error", frozen=True):
    """Call ``id`` failed inside the model; the worker is still able to take the next call."""

    id: int
    message: str


class Add(Frame, tag="add", frozen=True):
    """Queue sequence ``rid`` (the pool's number, unique among the worker's live sequences),
    whose :class:`Sampling` is spelled out field by field (:meth:`of`, :attr:`sampling`).
    ``output_tokens`` resumes a sequence another engine started: what it had generated, which
    the engine recomputes with the prompt and continues after (its ``max_tokens`` counts them)."""

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[tuple[int, float]] = []
    weight: float = 1.0  # its tenant's weight within its tier (workers.shares)
    output_tokens: list[int] = []  # what it generated on an engine that died: it resumes after them
    tpot_target: float = 0.0  # seconds per output token its tier promises; 0: none (workers.engine.seats)

    @classmethod
    def of(cls, rid: int, prompt_tokens: list[int], tier: int, tenant: str, sampling: Sampling,
           weight: float = 1.0, output_tokens: list[int] | None = None, tpot_target: float = 0.0) -> Add:
        """The frame of a sequence whose ``sampling`` names its temperature."""
        s = sampling
        assert s.temperature is not None, "the pool sends the model's default temperature"
        return cls(rid, prompt_tokens, s.max_tokens, tier, tenant, s.temperature, s.top_p, s.top_k, s.seed,
                   list(s.stop_token_ids), s.ignore_eos, s.presence_penalty, s.frequency_penalty,
                   s.repetition_penalty, s.min_p, list(s.logit_bias), weight, output_tokens or [],
                   tpot_target)

    @property
    def sampling(self) -> Sampling:
        """Its sampling; ValueError if a value is out of range."""
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                        tuple(self.stop_token_ids), self.ignore_eos, self.presence_penalty,
                        self.frequency_penalty, self.repetition_penalty, self.min_p,
                        tuple((token, bias) for token, bias in self.logit_bias))


class Abort(Frame, tag="abort", frozen=True):
    """Drop sequence ``rid`` (its client went away); a ``finished`` frame says ``aborted``."""

    rid: int


class Tokens(Frame, tag="tokens", frozen=True):
    """The tokens sequence ``rid`` generated in one step, in order."""

    rid: int
    ids: list[int]


FinishReasonName = Literal["eos", "stop_token", "max_tokens", "aborted", "too_long"]


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The tokens a job used: its prompt, the part of it the prefix cache supplied, its output.
    The one type from an engine's ``finished`` frame to the bill."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class SequenceFinished(Frame, tag="finished", frozen=True):
    """Sequence ``rid`` ended; no frame names it afterwards."""

    rid: int
    reason: FinishReasonName
    usage: Usage


class EngineStats(Frame, tag="stats", frozen=True):
    """The engine's load: gauges now, and counters since it started (tokens, not requests).

    The one record of an engine's load: the engine computes it, the ``stats`` frame carries it
    as it is, and the pool keeps the last one of each replica (with :meth:`plus_counters`, the
    counters of its engines that died before it).
    """

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "step", "preemptions", "prefix_queries", "prefix_hits", "computed_tokens", "generated_tokens",
    )
    """The fields that only grow while an engine lives; the others are gauges."""

    step: int  # steps run
    running: int
    waiting: int
    free_blocks: int  # cached ones included: they are evicted on demand
    used_blocks: int
    total_blocks: int
    cached_blocks: int  # free blocks still holding a prefix
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    computed_tokens: int  # prompt chunks and decodes computed
    generated_tokens: int  # tokens sampled

    def plus_counters(self, other: EngineStats) -> EngineStats:
        """These gauges, with ``other``'s counters added to these counters."""
        added = {name: getattr(self, name) + getattr(other, name) for name in self.COUNTERS}
        return msgspec.structs.replace(self, **added)


NO_ENGINE_STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
"""All zero: a replica before its first engine, and the gauges of one whose engine is gone."""


class StepBegun(Frame, tag="step", frozen=True):
    """The engine starts a step it expects to take ``seconds`` (inf: it has measured no step to
    tell by), so that a silence that long is not a hang: no ``stats`` frame comes until the step
    ends. Sent only for a step that would delay the next ``stats`` frame, and followed by
    ``stats`` as the step ends; the pool bounds what it allows whatever the figure
    (``batcher.continuous.silence``). NaN and negative figures are refused. A frame of its own,
    not a field of ``stats``: ``stats`` come after a step, at most once in 200 ms, and this must
    reach the pool before the step, each time one starts that will be long."""

    seconds: Annotated[float, msgspec.Meta(ge=0.0)]


class KvBlocks(Frame, tag="kv", frozen=True):
    """Part of sequence ``rid``'s KV on its way to another engine: the bytes of whole blocks."""

    rid: int
    data: bytes


class KvExported(Frame, tag="kv_exported", frozen=True):
    """Sequence ``rid`` made its first token and left this (prefill) engine: its ``kv`` frames
    are sent; exporting them took ``seconds``."""

    rid: int
    manifest: KvManifest
    seconds: float


class KvTaken(Frame, tag="kv_taken", frozen=True):
    """This (decode) engine took sequence ``rid``'s hand-off: reading, checking and writing its
    KV took ``seconds``, and from then to the write of the step after it ``stepped`` (sent with
    that step's frames, so that the pool can tell its pause apart: see
    ``batcher/continuous/handoff_phases.py``)."""

    rid: int
    seconds: float
    stepped: float


class KvHandoff(Frame, tag="kv_handoff", frozen=True):
    """Run ``add`` (its ``output_tokens`` end with the token the prefill engine made) over the
    KV of the ``kv`` frames just sent for its rid, once they pass the manifest's checks."""

    add: Add
    manifest: KvManifest


Message = (
    Ready | Unloadable | RunBatch | Skip | Accepted | Result | Error
    | Add | Abort | Tokens | SequenceFinished | EngineStats | StepBegun
    | KvBlocks | KvExported | KvHandoff | KvTaken
)
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_ENCODER = msgspec.msgpack.Encoder()


class _Kind(msgspec.Struct):
    """Only a frame's ``kind``: read again, on the error path, to say which frame was bad."""

    kind: str | None = None


_KINDS = {cls.__struct_config__.tag for cls in typing.get_args(Message)}


def encode(message: Message, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: the 4-byte length and the msgpack map of ``message``."""
    frame = bytearray(_HEADER.size)
    _ENCODER.encode_into(message, frame, _HEADER.size)
    length = len(frame) - _HEADER.size
    if length > max_frame:
        raise ProtocolError(f"{message.kind} frame of {length} bytes exceeds {max_frame}")
    _HEADER.pack_into(frame, 0, length)
    return bytes(frame)


def decode_body(body: bytes) -> Message:
    """The message in one frame body, or :class:`ProtocolError` saying what is wrong with it
    and where (``result.id``: the ``id`` field of a ``result`` frame)."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_where(body, str(exc))) from None
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep to read
        raise ProtocolError(f"frame is not msgpack: {exc}") from None


def _where(body: bytes, complaint: str) -> str:
    """``complaint`` with its path (``$`` is the frame) starting at the frame's kind."""
    try:
        kind = msgspec.msgpack.decode(body, type=_Kind).kind
    except (msgspec.DecodeError, RecursionError):
        kind = None
    frame = kind if kind in _KINDS else "frame"
    if " - at `$" not in complaint:
        complaint += " - at `$`"
    return "bad frame: " + complaint.replace("`$", f"`{frame}")


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

    def feed(self, data: bytes | bytearray) -> list[Message]:
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
