"""The lost replica, one scenario for both clocks: four streams and four whole answers over two
replicas (``place_streams_and_wholes``), replica 0's engine lost after its streams have shown
text, and what must follow (``check_replica_0_lost``). Simulated engines run it in virtual time,
real engine processes on the real clock."""

from __future__ import annotations

from batcher.core.backend import Delta, Failed, Finished, Started
from batcher.core.errors import ReplicaLost
from tests.support.engine_pool import Client, job


def place_streams_and_wholes(pool) -> tuple[list[Client], list[Client]]:
    """Four streams and four whole answers, alternating between two replicas."""
    streams = [Client() for _ in range(4)]
    wholes = [Client() for _ in range(4)]
    placed = [pool.submit(job(i, 600, stream=True), c) for i, c in enumerate(streams)]
    placed += [pool.submit(job(10 + i, 120, stream=False), c) for i, c in enumerate(wholes)]
    assert [t.replica for t in placed] == [0, 1, 0, 1, 0, 1, 0, 1]  # least queued tokens
    return streams, wholes


async def check_replica_0_lost(pool, streams: list[Client], wholes: list[Client]) -> None:
    """Replica 0 died under :func:`place_streams_and_wholes`: its streams that showed text end
    with an error saying what they had, and the whole answers all complete, unseen, as they
    would have alone."""
    for client in streams + wholes:
        await client.done.wait()
    for lost in streams[0::2]:
        failed = lost.events[-1]
        assert isinstance(failed, Failed) and isinstance(failed.error, ReplicaLost) and failed.retryable
        assert failed.tokens_sent == lost.delivered == len(lost.text.encode()) > 0
    for kept in streams[1::2]:
        assert isinstance(kept.events[-1], Finished) and kept.delivered == 600
    for index, whole in enumerate(wholes):  # replica 0's on replica 1
        assert [type(e) for e in whole.events] == [Started, Delta, Finished]
        solo = Client()
        pool.submit(job(10 + index, 120, stream=False), solo)
        await solo.done.wait()
        assert whole.text == solo.text and len(whole.text) == 120
    counters = pool.snapshot().counters
    assert (counters.reruns, counters.interrupted, counters.restarts) == (2, 2, 1)
