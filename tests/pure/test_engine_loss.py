"""Streams that survive their engine (``on_engine_loss = "resume"``), in virtual time over
simulated engines (their tokens a hash of the sequence so far, as a seeded model's are): the
fate of a lost job by rule, a resumed stream's text against an uninterrupted run's, its usage,
and a second loss against ``max_attempts``. The same with SmolLM2's real engines:
``tests/system/test_engine_resume.py``; the engine's side: ``tests/engine/test_engine_resume.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_loss import Fate, fate
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling, Started
from batcher.core.config import QueueConfig
from batcher.core.errors import ReplicaLost
from tests.support.engine_pool import Client, engines, job
from tests.support.waiting import until_trio


def seeded(index: int, max_tokens: int) -> Job:
    """A stream of ``max_tokens`` sampled with seed ``index``."""
    return dataclasses.replace(job(index, max_tokens, stream=True), sampling=Sampling(max_tokens, seed=index))


@pytest.mark.parametrize(
    ("sent", "generated", "attempts", "resume", "expected"),
    [
        (0, 5, 1, True, Fate.RERUN),  # nothing shown: from its prompt, whatever the rule
        (0, 5, 3, True, Fate.FAIL),
        (4, 5, 1, False, Fate.INTERRUPT),
        (4, 5, 1, True, Fate.RESUME),
        (4, 5, 3, True, Fate.INTERRUPT),  # lost max_attempts times: it ends with what it showed
        (4, 20, 1, True, Fate.COMPLETE),  # every token taken, only its end frame lost
    ],
)
def test_a_lost_job_is_rerun_resumed_interrupted_failed_or_completed_by_what_it_showed(
    sent, generated, attempts, resume, expected
):
    assert fate(sent=sent, generated=generated, max_tokens=20, attempts=attempts, max_attempts=3,
                resume=resume) is expected


def test_on_engine_loss_is_error_or_resume_and_resume_needs_ferrys_engine():
    with pytest.raises(ValueError, match=r"on_engine_loss: expected one of .'error', 'resume'., got 'retry'"):
        ContinuousModelConfig(name="sim@1", simulated="llama-70b", on_engine_loss="retry")
    with pytest.raises(ValueError, match="on_engine_loss: expected 'error' unless engine = \"ferry\""):
        ContinuousModelConfig(name="m@1", model="smollm2-135m", engine="vllm", on_engine_loss="resume")


async def test_a_resumed_stream_reads_as_an_uninterrupted_run_with_no_error_and_its_tokens_billed_once(
    autojump_clock,
):
    async with engines(workers=2, on_engine_loss="resume") as (pool, spawn):
        streams = [Client() for _ in range(4)]
        placed = [pool.submit(seeded(i, 300), c) for i, c in enumerate(streams)]
        assert [t.replica for t in placed] == [0, 1, 0, 1]
        await until_trio(lambda: all(c.delivered > 20 for c in streams), "text on every stream", every=0.001)
        spawn.current(0).kill()
        for client in streams:
            await client.done.wait()
        for i, client in enumerate(streams):
            solo = Client()
            pool.submit(seeded(i, 300), solo)
            await solo.done.wait()
            assert [type(e) for e in client.events[:2]] == [Started, Delta] and client.events.count(
                client.events[0]) == 1
            assert not any(isinstance(e, Failed) for e in client.events)
            assert client.text == solo.text and len(client.text) == 300
            finished = client.events[-1]
            assert isinstance(finished, Finished) and finished.usage.output_tokens == client.delivered == 300
            assert finished.usage.prompt_tokens == 10
        counters = pool.snapshot().counters
        assert (counters.resumed, counters.interrupted, counters.reruns) == (2, 0, 0)


async def test_a_resumed_stream_lost_again_at_max_attempts_ends_with_what_it_showed(autojump_clock):
    async with engines(workers=2, on_engine_loss="resume", max_attempts=2) as (pool, spawn):
        client = Client()
        ticket = pool.submit(seeded(7, 600), client)
        for shown in (50, 100):
            await until_trio(lambda n=shown: client.delivered > n, "more text", every=0.001)
            spawn.current(ticket.replica).kill()
        await client.done.wait()
        failed = client.events[-1]
        assert isinstance(failed, Failed) and isinstance(failed.error, ReplicaLost) and failed.retryable
        assert failed.tokens_sent == client.delivered > 100
        counters = pool.snapshot().counters
        assert (counters.resumed, counters.interrupted) == (1, 1)


async def test_a_resumed_stream_waits_past_its_tier_budget_for_the_restart_of_the_only_engine(autojump_clock):
    # A re-run that no engine takes within its tier's budget fails (test_engine_pool.py); a stream
    # whose client is reading waits as an admitted request may: the restart comes after 0.1 s.
    async with engines(workers=1, on_engine_loss="resume", queue=QueueConfig(wait_budgets=(0.05, 0.05))) as (
        pool, spawn,
    ):
        client = Client()
        pool.submit(seeded(3, 200), client)
        await until_trio(lambda: client.delivered > 20, "text on the stream", every=0.001)
        spawn.current(0).kill()
        await client.done.wait()
        solo = Client()
        pool.submit(seeded(3, 200), solo)
        await solo.done.wait()
    assert isinstance(client.events[-1], Finished) and client.text == solo.text and len(client.text) == 200
