"""The pool's side of the prefill -> decode hand-off, pure (``batcher.continuous.handoff``): a
hand-off that finds no decode replica up waits in the pool with its KV bytes, and while it waits
the pool's prefill replicas start nothing new (``stalled``), so the bytes held stay what the
prefill engines held, not their output over the whole wait; once a decode replica is up the
hand-off goes there and the stall ends; past its patience it fails, and the stall ends too.
Over real engines: ``tests/system/test_kv_handoff.py``."""

from __future__ import annotations

import math

import trio
import trio.testing

from batcher.continuous.handoff import Handoffs
from batcher.continuous.metrics import ContinuousCounters
from batcher.continuous.replica import Replica
from batcher.continuous.ticket import Stage, Ticket
from batcher.continuous.token_stream import Output
from batcher.core.backend import Failed, Job, Sampling
from batcher.core.config import QueueConfig
from gateway.text.tokenizer import ByteTokenizer
from workers.protocol import Add, KvBlocks, KvExported, KvManifest

PATIENCE, RID = 5.0, 7


def replica(index: int, counters: ContinuousCounters) -> Replica:
    r = Replica(index, QueueConfig(), counters, lambda: None, lambda: None)
    r.free_blocks = 100
    return r


def handed(events: list) -> tuple[Handoffs, Replica, Replica]:
    """A hand-off of one sequence exported by a prefill replica while the one decode replica is down."""
    counters = ContinuousCounters()
    prefill, decode = replica(0, counters), replica(1, counters)
    prefill.up = True
    job = Job("p", tuple(b"hello"), Sampling(8), "paid", "acme", stream=True)
    ticket = Ticket(Output(job, events.append, ByteTokenizer()), 0, 0.0, math.inf, [])
    ticket.state = Stage.PREFILLING

    def add(t: Ticket, rid: int) -> Add:
        greedy = t.job.sampling.replace(temperature=0.0)
        return Add.of(rid, list(t.job.prompt_tokens), t.tier, t.tenant, greedy)

    handoffs = Handoffs([decode], max_seqs=8, block_size=16, counters=counters, add=add,
                        patience=lambda tier: PATIENCE)
    prefill.start(ticket, add(ticket, RID), blocks=1, now=0.0)
    handoffs.take(prefill, KvBlocks(RID, b"\0" * 64))
    handoffs.take(prefill, KvExported(RID, KvManifest(5, 1, 64, b"", 0), 0.01))
    return handoffs, prefill, decode


def test_a_hand_off_with_no_decode_replica_up_stalls_the_prefill_replicas_until_one_is_up():
    async def main() -> None:
        handoffs, prefill, decode = handed([])
        assert handoffs.stalled and not prefill.live and not decode.live  # it left the prefill engine
        await trio.sleep(1.0)
        assert handoffs.flush(trio.current_time()) == PATIENCE and handoffs.stalled
        decode.up = True
        assert handoffs.flush(trio.current_time()) == math.inf
        assert not handoffs.stalled and list(decode.live) == [RID]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_hand_off_past_its_patience_fails_its_request_and_the_stall_ends():
    async def main() -> None:
        events: list = []
        handoffs, _prefill, decode = handed(events)
        await trio.sleep(PATIENCE)
        assert handoffs.flush(trio.current_time()) == math.inf
        assert not handoffs.stalled and not decode.live
        assert isinstance(events[-1], Failed)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
