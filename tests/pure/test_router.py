"""The router, pure: which replica wins for given loads and prefix holders, pinned; its prefix
hashes are the engine's own; its picture of each cache forgets in the engine's LRU order."""

from __future__ import annotations

import pytest

from batcher.continuous.router import Route, Router
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence
from workers.prefix_hash import prefix_hashes

BS = 4


def prompt(seed: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks and one more token (the last is never a hit)."""
    return [seed * 1000 + i for i in range(blocks * BS + 1)]


def holding(capacity: list[int], bound: float, held: dict[int, list[int]]) -> Router:
    """A router whose replica ``i`` was sent ``held[i]`` (a prompt)."""
    router = Router(capacity, bound)
    for replica, tokens in held.items():
        router.sent(replica, prefix_hashes(tokens, BS, "m@1", "acme"))
    return router


def hashes(tokens: list[int], tenant: str = "acme") -> list[bytes]:
    return prefix_hashes(tokens, BS, "m@1", tenant)


def test_without_a_prefix_the_least_loaded_replica_wins_and_ties_go_to_the_lowest_index():
    router = Router([64, 64, 64], bound=100)
    assert router.choose([30, 10, 10], []) == Route(1, 0)
    assert router.choose([30, 10, 10], hashes(prompt(1, 3))) == Route(1, 0)  # nobody holds it
    assert router.choose([0, 0, 0], []) == Route(0, 0)


def test_the_replica_holding_the_prefix_wins_while_it_is_within_the_bound_of_the_least_loaded():
    system = prompt(7, 3)
    router = holding([64, 64, 64], 100, {2: system})
    request = hashes([*system[:-1], 99, 98, 97])  # the same three blocks, another question
    assert router.choose([0, 50, 90], request) == Route(2, 3)
    assert router.choose([0, 50, 100], request) == Route(2, 3)  # exactly at the bound: still its
    assert router.choose([0, 50, 101], request) == Route(0, 0)  # over it: the least loaded


def test_among_holders_within_the_bound_the_longest_held_prefix_wins_then_the_lighter_one():
    long = prompt(3, 4)
    router = holding([64, 64, 64, 64], 100, {1: long[: 2 * BS + 1], 2: long, 3: long})
    request = hashes(long)
    assert router.choose([0, 10, 60, 40], request) == Route(3, 4)  # 2 and 3 hold 4 blocks: 3 is lighter
    assert router.choose([0, 10, 150, 140], request) == Route(1, 2)  # 2 and 3 are over the bound
    assert router.choose([0, 10, 60, 60], request) == Route(2, 4)  # a tie in load: the lower index


def test_a_replica_that_is_down_never_wins_and_with_none_up_there_is_no_route():
    system = prompt(5, 2)
    router = holding([64, 64, 64], 100, {0: system})
    assert router.choose([None, 5, 1], hashes(system)) == Route(2, 0)
    with pytest.raises(ValueError, match="no live replica"):
        router.choose([None, None, None], hashes(system))


def test_a_replica_that_lost_its_engine_holds_nothing():
    system = prompt(5, 2)
    router = holding([64, 64], 100, {1: system})
    router.forget(1)
    assert router.held(1, hashes(system)) == 0 and router.choose([0, 0], hashes(system)) == Route(0, 0)


def test_tenants_never_share_a_prefix():
    system = prompt(8, 3)
    router = holding([64, 64], 1000, {1: system})
    assert router.choose([0, 0], hashes(system, "acme")) == Route(1, 3)
    assert router.choose([0, 0], hashes(system, "rival")) == Route(0, 0)


def test_the_picture_of_a_cache_keeps_as_many_blocks_as_the_cache_and_forgets_a_prompts_tail_first():
    a, b = prompt(1, 3), prompt(2, 3)
    router = holding([4], 0, {0: a})
    assert router.held(0, hashes(a)) == 3
    router.sent(0, hashes(b))  # 6 blocks sent to a cache of 4: a's tail goes, its first block stays
    assert (router.held(0, hashes(a)), router.held(0, hashes(b))) == (1, 3)
    router.resize(0, 2)
    assert (router.held(0, hashes(a)), router.held(0, hashes(b))) == (0, 2)


def test_prefix_hashes_are_the_engines_block_hashes_up_to_the_block_before_the_last_token():
    for length in (1, BS, BS + 1, 3 * BS, 3 * BS + 1, 5 * BS + 3):
        tokens = list(range(100, 100 + length))
        blocks = BlockManager(64, BS, salt="m@1")
        seq = Sequence(0, tokens, tenant="acme")
        blocks.lookup(seq)  # extends the sequence's hash chain as far as a hit can reach
        assert hashes(tokens) == seq.block_hashes and len(seq.block_hashes) == (length - 1) // BS
