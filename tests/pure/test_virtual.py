"""run_virtual: one seed, one order of simultaneous tasks, whether or not Hypothesis was imported.

pytest's Hypothesis plugin imports Hypothesis, which switches trio's scheduling rule; a child
process that never imports it is what ``ferry simulate`` runs as."""

from __future__ import annotations

import subprocess
import sys

import trio

from batcher.sim.virtual import run_virtual

TIES = """
import trio
from batcher.sim.virtual import run_virtual
from tests.pure.test_virtual import interleaving
print(run_virtual(interleaving, seed=SEED))
"""


async def interleaving() -> str:
    """Four tasks waking together three times: the order trio ran them in, as digits."""
    order: list[str] = []

    async def one(name: str) -> None:
        for _ in range(3):
            await trio.sleep(1)
            order.append(name)

    async with trio.open_nursery() as nursery:
        for name in "0123":
            nursery.start_soon(one, name)
    return "".join(order)


def test_a_seed_gives_the_same_order_with_and_without_hypothesis_imported():
    assert "hypothesis" in sys.modules  # this process: under pytest's plugin
    for seed in (0, 1):
        child = subprocess.run([sys.executable, "-c", TIES.replace("SEED", str(seed))],
                               capture_output=True, text=True, check=True, timeout=60)
        assert "hypothesis" not in child.stderr
        assert child.stdout.strip() == run_virtual(interleaving, seed=seed)


def test_seeds_differ_and_the_process_is_left_as_it_was():
    rule = trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    assert len({run_virtual(interleaving, seed=seed) for seed in range(4)}) > 1
    assert trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING is rule
