"""The production batcher and pool over simulated workers, in virtual time (MockClock).

Every time asserted here is exact virtual time: 0.2 s service, T = 0.15 s, hang_timeout 1 s. Each
``trio.sleep`` moves that clock to an instant the scenario names; none waits for something to happen.
"""

from __future__ import annotations

import pytest
import trio

from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import Overloaded, RequestFailed
from batcher.fixed.batcher import open_batcher
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.request import RequestState
from tests.support.fixed_batcher import HANG, SERVICE, Outcomes, T, running, texts
from tests.support.spawner import Spawner
from workers.faults import FaultPlan


async def serve_at_once(fleet: Spawner, inputs: list[str], workers: int = 2):
    """Enqueue every input (paid) at once, wait until all have ended; the batcher and requests."""
    async with running(fleet, workers) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(inputs)
        await outcomes.wait(len(inputs))
    return batcher, requests


async def test_fifty_arrivals_flush_at_once(autojump_clock):
    fleet = Spawner()
    batcher, requests = await serve_at_once(fleet, texts("r", 50))
    assert fleet.calls() == [texts("r", 50)]
    assert {(r.dispatched_at, r.finished_at) for r in requests} == {(0.0, SERVICE)}
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 50)]
    assert batcher.counters.flushes == {"size": 1}


async def test_forty_nine_arrivals_flush_at_exactly_t(autojump_clock):
    fleet = Spawner()
    batcher, requests = await serve_at_once(fleet, texts("r", 49))
    assert fleet.calls() == [texts("r", 49)]
    assert [r.dispatched_at for r in requests] == [pytest.approx(T, abs=1e-12)] * 49
    assert [r.finished_at for r in requests] == [pytest.approx(T + SERVICE, abs=1e-12)] * 49
    assert batcher.counters.flushes == {"timeout": 1}


async def test_a_late_arrival_completing_the_batch_flushes_it_by_size(autojump_clock):
    fleet = Spawner()
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        outcomes.add(texts("early", 49))
        await trio.sleep(0.1)  # virtual time: the late one arrives at t=0.1, inside T
        late = outcomes.add(["late"])
        await outcomes.wait(50)
    assert late[0].dispatched_at == pytest.approx(0.1)
    assert batcher.counters.flushes == {"size": 1}


async def forty_free_then_forty_paid(fleet: Spawner):
    """One worker; 40 free requests, then 40 paid ones, all at t=0. Returns the batcher."""
    async with running(fleet, workers=1) as batcher:
        outcomes = Outcomes(batcher)
        outcomes.add(texts("free", 40), tier="free")
        outcomes.add(texts("paid", 40), tier="paid")
        await outcomes.wait(80)
    return batcher


async def test_paid_requests_go_before_free_ones_queued_earlier(autojump_clock):
    fleet = Spawner()
    await forty_free_then_forty_paid(fleet)
    assert fleet.calls() == [texts("paid", 40) + texts("free", 10), texts("free", 40)[10:]]


async def test_free_requests_fill_the_spare_slots_of_a_paid_batch(autojump_clock):
    fleet = Spawner()
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        for i in range(5):
            outcomes.add([f"free{i}"], tier="free")
            outcomes.add([f"paid{2 * i}", f"paid{2 * i + 1}"], tier="paid")
        await outcomes.wait(15)
    assert fleet.calls() == [texts("paid", 10) + texts("free", 5)]


async def test_a_crash_mid_batch_is_retried_and_completes_on_another_worker(autojump_clock):
    fleet = Spawner(plans={0: FaultPlan(crash_on_call=1)})
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 50))
        await outcomes.wait(50)
        restarted = [info.slot for info in batcher.pool.workers() if info.restarts]
    assert fleet.calls(0)[0] == fleet.calls(1)[0] == texts("r", 50)
    assert [r.state for r in requests] == [RequestState.DONE] * 50
    # the crash comes halfway through the call; the retry starts at once on worker 1
    assert [r.finished_at for r in requests] == [pytest.approx(SERVICE / 2 + SERVICE)] * 50
    assert (batcher.counters.retries, batcher.counters.restarts, restarted) == (1, 1, [0])


async def test_a_hang_is_detected_at_hang_timeout_and_completes_elsewhere(autojump_clock):
    fleet = Spawner(plans={0: FaultPlan(hang_on_call=1)})
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 50))
        await outcomes.wait(50)
        hung, replacement = [worker for slot, worker in fleet.spawned if slot == 0]  # killed, replaced
        assert hung.stopped and hung.calls == [texts("r", 50)] and not replacement.stopped
    assert fleet.calls(1) == [texts("r", 50)]
    assert [r.finished_at for r in requests] == [pytest.approx(HANG + SERVICE)] * 50
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 50)]


async def test_one_poison_input_among_fifty_fails_alone(autojump_clock):
    poison = FaultPlan(poison="☠")
    fleet = Spawner(plans={0: poison, 1: poison})
    inputs = texts("r", 50)
    inputs[37] = "r37 ☠"
    batcher, requests = await serve_at_once(fleet, inputs)
    failed = [r for r in requests if r.state is RequestState.FAILED]
    assert [r.input for r in failed] == ["r37 ☠"]
    assert isinstance(failed[0].error, RequestFailed)
    assert str(failed[0].error) == "the input failed on 3 attempts; last: the model raised ValueError"
    assert [r.result() for r in requests if r is not failed[0]] == [t[::-1] for t in inputs if "☠" not in t]
    # 2 whole tries, then the half holding r37 is split: 50 -> 25 -> 13 -> 6 -> 3 -> 1
    assert batcher.counters.bisections == 5
    assert batcher.counters.restarts == 0  # a model error is the call's fault, not the worker's
    assert len(fleet.calls()) == 2 + 2 * 5 + 2  # both halves of each split + r37's 2nd, 3rd tries
    assert fleet.calls()[-1] == ["r37 ☠"]


async def test_a_wrong_number_of_outputs_fails_the_call_and_the_batch_is_retried(autojump_clock):
    fleet = Spawner(plans={0: FaultPlan(wrong_count_on_call=1)})
    batcher, requests = await serve_at_once(fleet, texts("r", 10))
    assert [r.result() for r in requests] == [t[::-1] for t in texts("r", 10)]
    assert (batcher.counters.retries, batcher.counters.restarts) == (1, 0)
    assert len(fleet.calls(1)) == 1


async def test_cancelled_requests_leave_the_queue_at_once_and_never_reach_a_worker(autojump_clock):
    fleet = Spawner()
    async with running(fleet, workers=1) as batcher:
        outcomes = Outcomes(batcher)
        outcomes.add(texts("busy", 50))  # keeps the only worker busy until t=0.2
        await trio.sleep(0.01)  # virtual time: t=0.01, the busy batch is on the worker
        results = {}

        async def caller(text: str, patience: float) -> None:
            with trio.move_on_after(patience):
                results[text] = await batcher.answer(text, "paid")

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(caller, f"w{i}", 0.05 if i % 3 == 0 else 10.0)
            await trio.sleep(0.02)  # virtual time: t=0.02, every caller is queued
            assert len(batcher.queue) == 10
            await trio.sleep(0.05)  # virtual time: t=0.07, past the 0.05 s timeouts
            assert len(batcher.queue) == 6  # w0, w3, w6, w9 gave up at t=0.06
    gone = {"w0", "w3", "w6", "w9"}
    assert not gone & set(fleet.inputs_seen())
    assert results == {f"w{i}": f"w{i}"[::-1] for i in range(10) if f"w{i}" not in gone}
    assert batcher.counters.cancelled == 4


async def test_a_request_cancelled_after_dispatch_has_its_output_dropped(autojump_clock):
    fleet = Spawner()
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = outcomes.add(texts("r", 5))
        await trio.sleep(T + SERVICE / 2)  # virtual time: mid-call (the batch went at T)
        batcher.cancel(requests[2])
        await outcomes.wait(5)
    assert "r2" in fleet.inputs_seen()
    done, cancelled = RequestState.DONE, RequestState.CANCELLED
    assert [r.state for r in requests] == [done, done, cancelled, done, done]
    assert requests[2].output is None


async def test_a_request_that_cannot_be_dispatched_by_its_deadline_is_overloaded(autojump_clock):
    fleet = Spawner(service=5.0)
    async with running(fleet, workers=1) as batcher:
        outcomes = Outcomes(batcher)
        outcomes.add(texts("busy", 50))
        await trio.sleep(0.01)  # virtual time: t=0.01, the busy batch is on the worker
        with pytest.raises(Overloaded, match=r"not dispatched within 1.000s"):
            await batcher.answer("late", "paid", timeout=1.0)
        assert trio.current_time() == pytest.approx(1.01)
    assert "late" not in fleet.inputs_seen()
    assert batcher.counters.expired == 1


async def test_each_request_ends_exactly_once(autojump_clock):
    fleet = Spawner(plans={0: FaultPlan(crash_on_call=2), 1: FaultPlan(poison="☠")})
    async with running(fleet) as batcher:
        outcomes = Outcomes(batcher)
        requests = []
        for wave in range(6):
            requests += outcomes.add([f"{wave}-{i}" + ("☠" if i == 7 else "") for i in range(30)])
            batcher.cancel(requests[-1])
            await trio.sleep(0.1)  # virtual time: a wave every 0.1 s
        await outcomes.wait(len(requests))
        await trio.sleep(5)  # virtual time: 5 s more, in which nothing may end twice
    assert sorted(r.id for r in outcomes.ended) == sorted(r.id for r in requests)
    assert all(r.done for r in requests)


async def test_unknown_tier_is_refused_by_name(autojump_clock):
    async with running(Spawner()) as batcher:
        with pytest.raises(ValueError, match="tier: expected one of \\['paid', 'free'\\], got 'gold'"):
            await batcher.answer("x", "gold")


async def test_batch_sizes_and_queue_waits_by_tier_are_counted_for_metrics(autojump_clock):
    counters = (await forty_free_then_forty_paid(Spawner())).counters
    assert dict(counters.batch_sizes.cumulative())["32"] == 1 and counters.batch_sizes.count == 2  # 50 and 30
    assert counters.batch_sizes.total == 80
    assert (counters.queue_wait[0].count, counters.queue_wait[1].count) == (40, 40)
    assert counters.queue_wait[1].total == pytest.approx(10 * 0.0 + 30 * SERVICE)  # 30 free waited a call


async def test_the_pool_reports_every_answered_call_and_its_recent_duration(autojump_clock):
    fleet = Spawner(plans={0: FaultPlan(crash_on_call=1)})
    async with running(fleet) as batcher:
        answered = []
        batcher.pool.on_answer = lambda size, seconds: answered.append((size, seconds))
        outcomes = Outcomes(batcher)
        outcomes.add(texts("r", 50))
        await outcomes.wait(50)
        live = batcher.pool.live_workers
    assert answered == [(50, pytest.approx(SERVICE))]  # the crashed call is not an answer
    assert batcher.pool.call_seconds == pytest.approx(SERVICE)
    assert live == 2


async def test_over_budget_arrivals_are_shed_free_first_with_the_real_drain_time(autojump_clock):
    fleet = Spawner()
    pool = PoolConfig(workers=1, hang_timeout=HANG)
    queue = QueueConfig(wait_budgets=(1.0, 0.3))
    async with open_batcher(fleet, pool, SizeOrTimeout(50, T), queue) as batcher:
        outcomes = Outcomes(batcher)
        await batcher.answer("warm-up", "paid")  # one answered call: the fleet drains 50 / 0.2 s
        assert batcher.load().drain_rate == pytest.approx(250.0)
        outcomes.add(texts("busy", 50))  # the only worker is busy until t + 0.2
        await trio.sleep(0.01)  # virtual time: the busy batch is on the worker
        start = trio.current_time()
        paid = outcomes.add(texts("paid", 100), tier="paid")  # waits up to 0.4 s of a 1 s budget
        free = outcomes.add(texts("free", 100), tier="free")  # free's budget shrinks to 0.18 s
        await outcomes.wait(250)
    assert [r.state for r in paid] == [RequestState.DONE] * 100
    assert [r.state for r in free] == [RequestState.FAILED] * 100
    drained = max(r.dispatched_at for r in paid) - start  # the 100 paid ahead of the free ones...
    assert drained == pytest.approx(0.39)  # ...left in the batches at 0.19 and 0.39 s
    assert [r.error.retry_after for r in free] == pytest.approx([drained] * 100)  # as the 529s said
    assert batcher.counters.shed == {1: 100}
    assert all(r.finished_at == pytest.approx(start) for r in free)  # shed at once


async def test_a_request_past_its_deadline_is_told_when_to_retry(autojump_clock):
    fleet = Spawner()
    async with running(fleet, workers=1) as batcher:
        await batcher.answer("warm-up", "paid")
        outcomes = Outcomes(batcher)
        outcomes.add(texts("busy", 50))
        await trio.sleep(0.01)  # virtual time: t=0.01, the busy batch is on the worker
        waiting = outcomes.add(texts("waiting", 100))
        with pytest.raises(Overloaded) as shed:
            await batcher.answer("late", "free", timeout=0.05)
        expired_at = trio.current_time()
        await outcomes.wait(150)
    drained = max(r.dispatched_at for r in waiting) - expired_at  # the 100 queued ahead of it
    assert drained == pytest.approx(0.34)  # left in the batches 0.14 and 0.34 s after it expired
    assert shed.value.retry_after == pytest.approx(drained)


async def test_with_wait_budgets_a_request_must_be_dispatched_within_its_tiers_budget(autojump_clock):
    queue = QueueConfig(wait_budgets=(1.0, 0.3))
    async with open_batcher(Spawner(), PoolConfig(workers=1), SizeOrTimeout(50, T), queue) as batcher:
        paid, free = batcher.request("p", "paid"), batcher.request("f", "free")
    assert (paid.deadline - paid.arrival, free.deadline - free.arrival) == (1.0, 0.3)


async def test_a_light_tenant_beside_a_heavy_backlog_goes_in_the_next_batch_the_heavy_is_shed(autojump_clock):
    pool, queue = PoolConfig(workers=1, hang_timeout=HANG), QueueConfig(wait_budgets=(1.0, 0.3))
    async with open_batcher(Spawner(), pool, SizeOrTimeout(50, T), queue) as batcher:
        outcomes = Outcomes(batcher)
        await batcher.answer("warm-up", "paid")
        outcomes.add(texts("busy", 50))
        await trio.sleep(0.01)  # virtual time: the busy batch is on the worker until 0.2 s
        start = trio.current_time()
        heavy = outcomes.add(texts("h", 300), tenant="heavy")  # 5 batches fit its 1 s budget
        light = outcomes.add(texts("l", 2), tenant="light")
        await outcomes.wait(352)
    assert [r.state for r in light] == [RequestState.DONE] * 2
    assert [r.dispatched_at - start for r in light] == pytest.approx([0.19] * 2)  # the 1st batch, not the 6th
    answered = [r for r in heavy if r.state is RequestState.DONE]
    shed = [r for r in heavy if r.error is not None and r.finished_at == pytest.approx(start)]  # at arrival
    assert (len(answered), len(shed)) == (248, 50)  # 2 admitted ones gave their places to light's
    drained = max(r.dispatched_at for r in answered) - start  # heavy's own backlog: 5 batches
    assert drained == pytest.approx(0.99)
    assert [r.error.retry_after for r in shed] == pytest.approx([drained] * 50)
