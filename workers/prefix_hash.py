"""The prefix cache's keys: the one hash chain that the engine's block manager and the gateway's
router must compute alike, or affinity routing would send prompts where their prefix is not.

A full block's key is ``hash(parent's key, its token ids)``; the first block's parent is a root
salted with the model version and the tenant, so no block matches across weights or tenants::

    root(version, tenant) ──> key 0 = h(root, tokens 0..15) ──> key 1 = h(key 0, tokens 16..31) ...

Pure (hashlib only), so ``batcher`` may import it without the engine, and the engine without
``batcher``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block: a strong hash of its parent's key and its tokens."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=32).digest()


def prefix_root(salt: str, tenant: str) -> bytes:
    """The parent of a sequence's first block: the model version and the tenant."""
    return hashlib.blake2b(repr((salt, tenant)).encode()).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, salt: str, tenant: str) -> list[bytes]:
    """The hash chain of ``tokens``' full blocks that the engine's prefix cache can hit: every
    full block but the one holding the last token (``(len - 1) // block_size`` of them), which
    the engine always computes to sample from it."""
    hashes, parent = [], prefix_root(salt, tenant)
    for start in range(0, (len(tokens) - 1) // block_size * block_size, block_size):
        parent = chain_hash(parent, list(tokens[start : start + block_size]))
        hashes.append(parent)
    return hashes
