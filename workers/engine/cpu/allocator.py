"""The engine process's heap: what a step frees is kept for the next step, not handed back.

A prefill step allocates and frees megabytes of activations per layer (2,048 tokens of SmolLM2's
MLP are 12 MiB in bfloat16, its float32 norms 4.7 MiB). glibc's malloc serves a block above its
mmap threshold with fresh pages from the kernel and, once more than its trim threshold lies free
at the top of the heap, gives that back; both thresholds start small and only adapt slowly. So
step after step the same buffers come back as new pages, and the kernel zero-fills each 4 KiB
page on first touch: 50,000-200,000 page faults in a 2,048-token prefill step on this machine,
about a tenth of its time. vLLM's CPU backend avoids the same cost by preloading tcmalloc;
setting glibc's own two thresholds once does it without another library:

    M_MMAP_THRESHOLD  32 MiB (glibc's largest): every activation of a step comes from the heap
    M_TRIM_THRESHOLD  1 GiB: the heap keeps what a step freed (it stays at the largest step's
                      size, which the KV cache beside it dwarfs)

Only the engine worker does this (its steps are the allocation pattern); anywhere the C library
is not glibc, nothing changes.
"""

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
