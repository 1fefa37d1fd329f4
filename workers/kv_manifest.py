"""What a KV hand-off between engines carries (its manifest, re-exported by
:mod:`workers.protocol`), and where its bytes are on one host: the shared-memory files, their
names, and unlinking one no engine will take (the pool's part; ``workers/engine/kv_transfer.py``
writes and reads them). Apart from the engine so that the pool imports no model code."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

SHM_DIR = Path("/dev/shm")
SEGMENT = re.compile(r"ferry-kv-[0-9]+-[0-9]+")
"""The only names a decode engine opens or the pool unlinks: ``ferry-kv-<engine pid>-<rid>``."""


def segment_name(pid: int, rid: int) -> str:
    """The segment an engine of ``pid`` writes sequence ``rid``'s KV to."""
    return f"ferry-kv-{pid}-{rid}"


def discard(segment: str) -> None:
    """Unlink a hand-off's segment that no engine will take (nothing if there is none)."""
    if SEGMENT.fullmatch(segment):
        (SHM_DIR / segment).unlink(missing_ok=True)


def write_segment(name: str, data: bytes) -> str:
    """``data`` in a new segment ``name`` (created exclusively), its name; "" if it cannot be
    (an old one of that name, not ours to touch; /dev/shm full or absent): send frames then."""
    try:
        with open(SHM_DIR / name, "xb") as segment:
            segment.write(data)
    except FileExistsError:
        return ""
    except OSError:
        discard(name)
        return ""
    return name


def read_segment(segment: str, size: int) -> bytearray:
    """At most ``size`` + 1 bytes of ``segment`` (one more: a longer file fails a count check),
    which is unlinked, read or not; ValueError: not a hand-off segment, or unreadable."""
    if not SEGMENT.fullmatch(segment):
        raise ValueError("not a hand-off segment")
    path = SHM_DIR / segment
    try:
        with open(path, "rb") as file:
            return bytearray(file.read(size + 1))
    except OSError:
        raise ValueError("its segment cannot be read") from None
    finally:
        path.unlink(missing_ok=True)


class KvManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a hand-off's ``kv`` frames hold: the KV of the first ``kv_tokens`` tokens of the
    sequence in ``blocks`` blocks of ``block_bytes`` bytes, ``digest`` their BLAKE2b-128; of its
    prompt, ``cached_tokens`` came from the sending engine's prefix cache (billed as cached)."""

    kv_tokens: int
    blocks: int
    block_bytes: int
    digest: bytes
    cached_tokens: int
    segment: str = ""  # the bytes are in this shared-memory file, not kv frames ("": frames)
