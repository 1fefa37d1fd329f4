"""The engine process's heap: what a step frees is kept for the next step, not handed back.

A prefill step allocates and frees megabytes of activations per layer, and glibc's malloc, whose
mmap and trim thresholds start small, hands them back and takes them again as fresh pages that
the kernel zero-fills on first touch, step after step. Setting the two thresholds once keeps
them on the heap, without another allocator library::

    M_MMAP_THRESHOLD  32 MiB (glibc's largest): every activation of a step comes from the heap
    M_TRIM_THRESHOLD  1 GiB: the heap keeps what a step freed (the KV cache beside it dwarfs it)

Only the engine worker does this; where the C library is not glibc, nothing changes
(docs/engine.md, "On a CPU"; measured in experiments/docs/engine-vs-vllm.md)."""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's two thresholds for this process; False (and nothing set) where the process's
    C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: another malloc
        return False
    mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mmap and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
