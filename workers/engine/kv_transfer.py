"""An engine's side of the prefill -> decode hand-off: a sequence's KV blocks out as bytes, and in.

A prefill engine (``--role prefill``) computes a prompt and its first token as any engine does;
then, instead of decoding, it exports the sequence (:meth:`KvTransfer.exports`): the KV of every
token but the last, read out of its blocks as ``kv`` frames of at most :data:`CHUNK_BYTES`,
and a ``kv_exported`` frame with the manifest (counts and a BLAKE2b digest), and the sequence
leaves the engine, its full blocks kept in the prefix cache. The pool forwards the ``kv`` frames
to a decode engine and sends it a ``kv_handoff`` frame (the sequence's ``add`` and the manifest)::

    prefill engine   tokens {rid, [t0]}, kv {rid, bytes} ..., kv_exported {rid, manifest}
    pool             t0 to the client; kv {rid, bytes} ..., kv_handoff {add, manifest} to a decode engine
    decode engine    checks count and digest, takes the blocks its prefix cache holds, writes the
                     rest, and decodes from t0 on (:meth:`KvTransfer.take`)

Any engine takes a hand-off, and says so with the frames of the step after (``kv_taken``: how
long the import took, and how long from then until that step's frames were written), so that
the pool can break the hand-off's pause into its parts. Bytes that fail the manifest's checks
break the protocol (the engine exits and the pool's rule for a lost engine applies); a hand-off
that finds no seat or no free blocks waits as a resumed sequence and is computed again there:
slower, never lost. The bytes waiting for their ``kv_handoff`` are bounded by the engine's own
cache size.

Shared memory, on one host: a prefill engine made with ``shm=True`` writes a sequence's KV into a
file in ``/dev/shm`` (named ``ferry-kv-<pid>-<rid>``, created exclusively) instead of ``kv``
frames, and its manifest names the segment; the pool forwards the manifest alone and the decode
engine reads the file, unlinks it (before its checks: a refused hand-off leaves nothing behind)
and imports as from frames. The bytes an engine has in segments not yet taken are bounded by
its own cache size (:meth:`KvTransfer.outstanding`); past that it sends frames: never more.
A segment whose hand-off never reaches a decode engine is unlinked by the pool
(:func:`discard`).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Protocol

import msgspec

from workers.engine.block_manager import cdiv
from workers.engine.engine import Engine
from workers.engine.interface import StepOutput
from workers.engine.sequence import Sequence
from workers.kv_manifest import SHM_DIR, read_segment, segment_name, write_segment
from workers.protocol import KvBlocks, KvExported, KvHandoff, KvManifest, KvTaken, Message, ProtocolError

CHUNK_BYTES = 8 << 20
"""The most KV bytes in one ``kv`` frame (whole blocks; one block at least), well under the
frame limit, so that a long prompt's KV is many frames rather than one too large."""

class KvCache(Protocol):
    """A runner whose KV cache can be read and written by block (``ModelRunner``)."""

    block_size: int
    num_blocks: int

    @property
    def block_bytes(self) -> int: ...

    def read_blocks(self, blocks: list[int]) -> bytes: ...

    def write_blocks(self, blocks: list[int], data: bytearray) -> None: ...


def digest(data: bytes | bytearray) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class KvTransfer:
    """Hand-offs into and, for a prefill engine, out of ``engine``, over ``cache``."""

    def __init__(self, engine: Engine, cache: KvCache, prefill: bool, shm: bool = False) -> None:
        self.engine, self.cache, self.prefill, self.shm = engine, cache, prefill, shm
        self._segments: dict[str, int] = {}  # segment -> bytes, written here, maybe not yet taken
        self._incoming: dict[int, bytearray] = {}  # rid -> the KV bytes sent so far
        self._buffered = 0
        self._taken: list[tuple[int, float, float]] = []  # rid, import seconds, when the import ended

    # --- out (a prefill engine) ---------------------------------------------------------

    def exports(self, output: StepOutput) -> list[Message]:
        """After a step: a ``kv_taken`` for every hand-off taken before it; then, on a prefill
        engine, every sequence that made its first token here (and goes on) leaves for a decode
        engine: its frames."""
        now = time.perf_counter()
        frames: list[Message] = [KvTaken(rid, seconds, now - done) for rid, seconds, done in self._taken]
        self._taken = []
        if not self.prefill:
            return frames
        for rid in output.tokens:
            seq = self.engine.scheduler.sequences.get(rid)
            if seq is not None:  # else it ended with that token: no hand-off
                frames += self._export(seq)
        return frames

    def _export(self, seq: Sequence) -> list[Message]:
        started = time.perf_counter()
        kv_tokens = seq.num_computed  # every token but the one just sampled
        blocks = seq.block_table[: cdiv(kv_tokens, self.cache.block_size)]
        data = self.cache.read_blocks(blocks)
        size = self.cache.block_bytes
        step = max(1, CHUNK_BYTES // size) * size
        manifest = KvManifest(kv_tokens, len(blocks), size, digest(data), seq.num_cached)
        frames: list[Message] = []
        segment = self._write(seq.rid, data) if self.shm else ""
        if segment:
            manifest = msgspec.structs.replace(manifest, segment=segment)
        else:
            frames = [KvBlocks(seq.rid, data[i : i + step]) for i in range(0, len(data), step)]
        self.engine.scheduler.release(seq)
        frames.append(KvExported(seq.rid, manifest, time.perf_counter() - started))
        return frames

    def outstanding(self) -> int:
        """The bytes in this engine's segments that no decode engine has taken yet."""
        self._segments = {name: n for name, n in self._segments.items() if (SHM_DIR / name).exists()}
        return sum(self._segments.values())

    def _write(self, rid: int, data: bytes) -> str:
        """``data`` in a new segment, its name; "" (send frames) past the bound or if it fails."""
        if self.outstanding() + len(data) > self.cache.num_blocks * self.cache.block_bytes:
            return ""
        name = write_segment(segment_name(os.getpid(), rid), data)
        if name:
            self._segments[name] = len(data)
        return name

    # --- in (any engine) ----------------------------------------------------------------

    @property
    def arriving(self) -> bool:
        """A hand-off's ``kv`` frames have come without their ``kv_handoff`` yet."""
        return bool(self._incoming)

    def take(self, message: Message) -> bool:
        """Take a hand-off's frame (False: ``message`` is not one)."""
        if isinstance(message, KvBlocks):
            self._buffered += len(message.data)
            if self._buffered > self.cache.num_blocks * self.cache.block_bytes:
                raise ProtocolError(f"kv {message.rid}: more KV bytes waiting than the whole cache holds")
            self._incoming.setdefault(message.rid, bytearray()).extend(message.data)
            return True
        if isinstance(message, KvHandoff):
            self._receive(message)
            return True
        return False

    def _receive(self, handoff: KvHandoff) -> None:
        started = time.perf_counter()
        self._import(handoff)
        done = time.perf_counter()
        self._taken.append((handoff.add.rid, done - started, done))

    def _import(self, handoff: KvHandoff) -> None:
        add, manifest = handoff.add, handoff.manifest
        data = self._incoming.pop(add.rid, bytearray())
        self._buffered -= len(data)
        if manifest.segment:
            try:
                data = read_segment(manifest.segment, manifest.blocks * manifest.block_bytes)
            except ValueError as exc:
                raise ProtocolError(f"kv_handoff {add.rid}: {exc}") from None
        self._check(handoff, data)
        engine = self.engine
        try:
            seq = Sequence(add.rid, add.prompt_tokens, add.sampling, tier=add.tier, tenant=add.tenant,
                           arrival=engine.clock(), weight=add.weight, output_ids=list(add.output_tokens))
            held = engine.scheduler.receive(seq, manifest.kv_tokens, engine.clock())
            if held is None:  # no room now: it waits, and is computed again here
                engine.scheduler.add(seq)
                return
        except ValueError as exc:
            raise ProtocolError(f"kv_handoff {add.rid} refused: {exc}") from None
        seq.num_cached = manifest.cached_tokens
        size = manifest.block_bytes
        if held < manifest.blocks:
            self.cache.write_blocks(seq.block_table[held : manifest.blocks], data[held * size :])

    def _check(self, handoff: KvHandoff, data: bytearray) -> None:
        """The bytes against the manifest: counts, then digest (ProtocolError naming the first
        that fails)."""
        add, manifest = handoff.add, handoff.manifest
        tokens = len(add.prompt_tokens) + len(add.output_tokens)
        complaint = ""
        if not add.output_tokens or manifest.kv_tokens != tokens - 1:
            complaint = f"expected KV of {tokens - 1} tokens, the manifest says {manifest.kv_tokens}"
        elif manifest.block_bytes != self.cache.block_bytes:
            complaint = f"blocks of {manifest.block_bytes} bytes, this engine's hold {self.cache.block_bytes}"
        elif manifest.blocks != cdiv(manifest.kv_tokens, self.cache.block_size):
            complaint = f"{manifest.blocks} blocks cannot hold exactly {manifest.kv_tokens} tokens"
        elif len(data) != manifest.blocks * manifest.block_bytes:
            complaint = f"{len(data)} bytes arrived, {manifest.blocks * manifest.block_bytes} expected"
        elif digest(data) != manifest.digest:
            complaint = "the bytes do not match their digest"
        if complaint:
            raise ProtocolError(f"kv_handoff {add.rid}: {complaint}")
