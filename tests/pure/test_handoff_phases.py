"""The parts of a hand-off's pause (``batcher.continuous.handoff_phases``), pure: they add up to
the pause whichever of the decode engine's ``kv_taken`` and first token comes first, they are
counted once per hand-off, and through a pool's replicas (MockClock) each part lands where it
was spent: waiting for a decode replica, in the pool's writer, in the decode engine. Over real
engines: ``tests/system/test_kv_handoff.py``."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from batcher.continuous.handoff import Handoffs
from batcher.continuous.handoff_phases import PHASES, HandoffPause
from batcher.continuous.metrics import HANDOFF_SECOND_BOUNDS, ContinuousCounters
from batcher.continuous.replica import Replica
from batcher.continuous.ticket import Stage, Ticket
from batcher.continuous.token_stream import Output
from batcher.core.backend import Job, Sampling
from batcher.core.config import QueueConfig
from batcher.core.counters import Histogram
from gateway.text.tokenizer import ByteTokenizer
from workers.protocol import Add, KvExported, KvManifest, KvTaken, Tokens

RID = 7
PAUSE_PARTS = ("send", "wait", "import", "step", "after")


def histograms() -> dict[str, Histogram]:
    return {phase: Histogram(HANDOFF_SECOND_BOUNDS) for phase in PHASES}


@pytest.mark.parametrize("taken_first", [False, True], ids=["token-first", "taken-first"])
def test_the_parts_add_up_to_the_pause_in_either_order_and_count_once(taken_first):
    pause = HandoffPause(exported_at=10.0, export=0.04)
    pause.handed_at = 10.5
    pause.sent(10.6)
    pause.sent(11.9)  # a later write of the same outbox changes nothing
    taken = KvTaken(RID, seconds=0.1, stepped=0.3)
    parts = histograms()
    if taken_first:  # the step after the import left the sequence out: its token came a step later
        pause.take(taken, 11.2)
        assert not pause.settle(parts)
        assert pause.first_token(11.4) == pytest.approx(0.9)
    else:  # the engine writes kv_taken after that step's tokens: the pool reads the token first
        assert pause.first_token(11.2) == pytest.approx(0.7)
        assert not pause.settle(parts)
        pause.take(taken, 11.2)
    assert pause.first_token(12.0) is None  # only the first token ends the pause
    phases = pause.phases()
    assert phases is not None
    assert phases["export"] == 0.04 and phases["queued"] == pytest.approx(0.5)
    assert phases["send"] == pytest.approx(0.1) and phases["import"] == 0.1 and phases["step"] == 0.3
    assert phases["after"] == pytest.approx(0.2 if taken_first else 0.0)
    assert phases["wait"] == pytest.approx(0.2)
    assert sum(phases[p] for p in PAUSE_PARTS) == pytest.approx(pause.token_at - pause.handed_at)
    assert pause.settle(parts)
    assert [parts[p].count for p in PHASES] == [1] * len(PHASES)


def test_a_write_noted_late_is_what_is_left_of_the_pause_not_more():
    pause = HandoffPause(exported_at=0.0, export=0.0)
    pause.handed_at = 1.0
    pause.take(KvTaken(RID, seconds=0.1, stepped=0.2), 1.5)
    pause.first_token(1.5)  # before the pool's writer noted its write
    phases = pause.phases()
    assert phases is not None and phases["send"] == pytest.approx(0.2) and phases["wait"] == 0.0


class SlowPipe:
    """The decode engine's pipe, taking ``seconds`` to take a write (the engine was stepping)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def send(self, data: bytes) -> None:
        await trio.sleep(self.seconds)


def test_through_the_pool_each_part_lands_where_it_was_spent():
    async def main() -> None:
        counters = ContinuousCounters()
        prefill, decode = (Replica(i, QueueConfig(), counters, lambda: None, lambda: None) for i in (0, 1))
        prefill.up, decode.free_blocks = True, 100
        job = Job("p", tuple(b"hello"), Sampling(8), "paid", "acme", stream=True)
        ticket = Ticket(Output(job, lambda event: None, ByteTokenizer()), 0, 0.0, math.inf, [])

        def add(t: Ticket, rid: int) -> Add:
            greedy = t.job.sampling.replace(temperature=0.0)
            return Add.of(rid, list(t.job.prompt_tokens), t.tier, t.tenant, greedy)

        handoffs = Handoffs([decode], max_seqs=8, block_size=16, counters=counters, add=add,
                            patience=lambda tier: 60.0)
        prefill.start(ticket, add(ticket, RID), blocks=1, now=0.0)
        prefill._step([Tokens(RID, [104])], trio.current_time())  # its first token, from the prefill engine
        await trio.sleep(1.0)
        handoffs.take(prefill, KvExported(RID, KvManifest(5, 1, 64, b"", 0), 0.05))
        assert handoffs.stalled  # no decode replica up: it waits
        await trio.sleep(2.0)
        decode.up = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(decode._write, SlowPipe(0.25))
            handoffs.flush(trio.current_time())
            assert ticket.state is Stage.RUNNING and list(decode.live) == [RID]
            await trio.sleep(1.0)
            decode._step([Tokens(RID, [105]), KvTaken(RID, 0.1, 0.3)], trio.current_time())
            nursery.cancel_scope.cancel()
        parts = {phase: counters.handoff_phases[phase].total for phase in PHASES}
        assert parts == pytest.approx({"export": 0.05, "queued": 2.0, "send": 0.25, "wait": 0.35,
                                       "import": 0.1, "step": 0.3, "after": 0.0})
        assert counters.handoff_seconds.total == pytest.approx(1.0)
        assert ticket.handoff is None  # counted, and only once

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
