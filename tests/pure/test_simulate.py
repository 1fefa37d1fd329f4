"""Virtual-time runs end to end: the new policies inside the production batcher, the trace
feed against on-time enqueueing, and conservation (every request ends once, with a reason)."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import trio
import trio.lowlevel

from batcher.core.config import PoolConfig, QueueConfig
from batcher.core.errors import Overloaded
from batcher.fixed.batcher import DeadlineUnreachable, open_batcher
from batcher.fixed.policy import AIMD, IdleAware, SizeOrTimeout, SlackDriven
from batcher.fixed.request import Request, RequestState
from batcher.sim.arrivals import Trace, poisson
from batcher.sim.fixed.load import drive
from batcher.sim.fixed.replay import Replay
from batcher.sim.fixed.simulate import Scenario, Service, simulate
from batcher.sim.fixed.workers import SimulatedWorker, linear
from tests.support.spawner import Spawner
from tests.support.waiting import until_trio
from workers.faults import FaultPlan


async def _ended(batcher, inputs, timeout=None) -> list[Request]:
    """Enqueue ``inputs`` now (paid) and wait until each has ended."""
    left = len(inputs)
    done = trio.Event()

    def on_done(_: Request) -> None:
        nonlocal left
        left -= 1
        if not left:
            done.set()

    requests = [batcher.request(text, "paid", timeout, on_done) for text in inputs]
    for request in requests:
        batcher.enqueue(request)
    await done.wait()
    return requests


@pytest.mark.parametrize(
    ("policy", "finished"), [(SizeOrTimeout(50, 0.15), 0.35), (IdleAware(50, 0.15), 0.2)]
)
async def test_idle_aware_sends_a_small_batch_at_once_while_workers_idle(autojump_clock, policy, finished):
    fleet = Spawner()
    async with open_batcher(fleet, PoolConfig(workers=8), policy) as batcher:
        requests = await _ended(batcher, ["a", "b", "c"])
    assert fleet.calls() == [["a", "b", "c"]]
    assert [r.finished_at for r in requests] == [pytest.approx(finished)] * 3


async def test_idle_aware_waits_when_only_the_last_worker_is_idle(autojump_clock):
    fleet = Spawner()
    async with open_batcher(fleet, PoolConfig(workers=2), IdleAware(50, 0.15)) as batcher:
        first = await _ended(batcher, ["a"])  # worker 0 takes it at t=0: worker 1 is left idle
        assert first[0].finished_at == pytest.approx(0.2)
        busy = [batcher.request("b", "paid")]
        batcher.enqueue(busy[0])  # t=0.2, two idle: goes at once
        await trio.sleep(0.01)  # virtual time: c and d arrive at t=0.21
        late = await _ended(batcher, ["c", "d"])  # one idle worker left: waits for T
    assert busy[0].dispatched_at == pytest.approx(0.2)
    assert [r.dispatched_at for r in late] == [pytest.approx(0.21 + 0.15)] * 2


async def test_slack_driven_holds_until_the_deadline_allows_no_more_and_drops_the_hopeless(autojump_clock):
    fleet = Spawner()
    policy = SlackDriven(50, service_time=0.2, margin=0.02)
    async with open_batcher(fleet, PoolConfig(workers=2), policy, QueueConfig(queue_timeout=30.0)) as batcher:
        hopeless, *_rest = await _ended(batcher, ["hopeless"], timeout=0.15) + [None]
        assert hopeless.finished_at == 0.0 and isinstance(hopeless.error, DeadlineUnreachable)
        assert isinstance(hopeless.error, Overloaded)  # a 529 to the HTTP side
        requests = await _ended(batcher, ["x", "y"], timeout=0.5)
    assert [r.dispatched_at for r in requests] == [pytest.approx(0.28)] * 2
    assert [r.finished_at for r in requests] == [pytest.approx(0.48)] * 2
    assert fleet.inputs_seen() == ["x", "y"]
    assert batcher.counters.flushes == {"slack": 1} and batcher.counters.expired == 1


async def test_aimd_learns_the_batch_size_from_the_calls_it_sees(autojump_clock):
    policy = AIMD(max_batch=50, target=0.2, step=5, start=5)

    def spawn(slot: int) -> SimulatedWorker:  # 0.1 s + 5 ms per input: 20 inputs take 0.2 s
        return SimulatedWorker(linear(0.1, 0.005))

    async with open_batcher(spawn, PoolConfig(workers=1), policy) as batcher:
        await _ended(batcher, [str(i) for i in range(200)])
    assert policy.limit == 20
    assert batcher.counters.flushes["size"] >= 5


def _trace(rate: float, seconds: float, seed: int = 3, budget: float | None = None) -> Trace:
    return Trace.of(poisson(rate, seconds, seed), {"paid": 0.3, "free": 0.7}, seed, budget)


@pytest.mark.parametrize(
    ("policy", "queue"),
    [
        (SizeOrTimeout(50, 0.15), QueueConfig()),
        (IdleAware(50, 0.15), QueueConfig()),
        (SlackDriven(50, 0.2, 0.02), QueueConfig()),
        (SizeOrTimeout(50, 0.15), QueueConfig(wait_budgets=(1.0, 0.1))),  # admission sheds free
    ],
)
def test_a_replayed_trace_is_scheduled_exactly_as_on_time_arrivals_are(policy, queue):
    """Each run in its own trio.run from virtual time 0, so both see the very same float times."""
    trace = _trace(1400.0, 3.0, budget=0.5)  # over the capacity of 4 workers: some drops
    pool = PoolConfig(workers=4)

    async def on_time() -> list[Request]:
        async with open_batcher(Spawner(), pool, policy, queue) as batcher:
            requests, _ = await drive(batcher, trace.times, [trace.tiers[i] for i in trace.tier], timeout=0.5)
        return requests

    async def replayed() -> list[Request]:
        ended: list[Request] = []
        async with open_batcher(Spawner(), pool, policy, queue) as batcher:
            batcher.feed(Replay(batcher, trace.times, trace.tier, trace.tiers, trace.deadlines, ended.append))
            await until_trio(lambda: len(ended) >= len(trace), "every request of the trace ended",
                             within=60.0, every=1.0)
        return ended

    def timeline(run) -> list[tuple]:
        requests = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
        ordered = sorted(requests, key=lambda r: (r.arrival, r.id))
        return [(r.state, r.arrival, r.tier, r.dispatched_at, r.finished_at) for r in ordered]

    expected = timeline(on_time)
    assert timeline(replayed) == expected
    assert {outcome[0] for outcome in expected} == {RequestState.DONE, RequestState.FAILED}


def test_every_request_is_answered_or_dropped_with_a_reason_exactly_once():
    faults = FaultPlan(crash_prob=0.05, hang_prob=0.02)
    scenario = Scenario(
        _trace(2500.0, 8.0, budget=0.6),  # over the capacity of 8 workers, with deadlines
        policy="slack_driven",
        workers=8,
        service=Service(0.15, 0.001, jitter=0.2),
        faults=faults,
        hang_timeout=0.5,
    )
    run = simulate(scenario)
    report = run.report
    assert report.offered == len(scenario.trace)
    assert report.completed + sum(report.errors.values()) == report.offered
    assert set(report.errors) <= {"DeadlineUnreachable", "Overloaded", "RequestFailed", "WorkersFailed"}
    assert report.errors["DeadlineUnreachable"] > 0 and report.restarts > 0 and report.retries > 0
    assert sum(report.dropped_by_tier.values()) == report.dropped
    assert run.virtual_seconds > 8.0 and run.requests_per_cpu_second > 0


def test_conservation_holds_request_by_request_under_faults():
    """The same run at the level of single requests: ids end once each, never twice."""
    trace = _trace(1500.0, 5.0, budget=0.4)
    ended: collections.Counter[int] = collections.Counter()
    states: dict[int, RequestState] = {}

    async def main() -> int:
        def spawn(slot: int) -> SimulatedWorker:
            return SimulatedWorker(
                linear(0.2), FaultPlan(crash_prob=0.1, hang_prob=0.05, seed=slot), record=False
            )

        def on_done(request: Request) -> None:
            ended[request.id] += 1
            states[request.id] = request.state
            assert request.state is RequestState.DONE or request.error is not None

        start = trio.current_time()
        pool = PoolConfig(workers=6, hang_timeout=0.6)
        async with open_batcher(spawn, pool, SlackDriven(50, 0.2, 0.02)) as batcher:
            batcher.feed(
                Replay(
                    batcher, trace.times + start, trace.tier, trace.tiers, trace.deadlines + start, on_done
                )
            )
            await until_trio(lambda: len(ended) >= len(trace), "every request of the trace ended",
                             within=60.0, every=1.0)
            await trio.sleep(5.0)  # virtual time: 5 s more, in which nothing may end twice, even late
            return batcher.counters.restarts

    restarts = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(ended) == len(trace) and set(ended.values()) == {1}
    assert restarts > 0 and RequestState.FAILED in states.values() and RequestState.DONE in states.values()


def test_a_simulation_is_a_function_of_its_seed():
    scenario = Scenario(_trace(800.0, 4.0), policy="idle_aware", service=Service(0.2, 0.0, jitter=0.3))
    first, again = simulate(scenario).report, simulate(scenario).report
    assert first == again
    assert simulate(scenario.with_(seed=1)).report != first


def test_report_counts_busy_time_and_progress_is_told():
    told = []
    run = simulate(Scenario(_trace(1000.0, 10.0), workers=8), told.append, every=2.0)
    assert [round(p.virtual_seconds) for p in told][:5] == [2, 4, 6, 8, 10]
    assert told[-1].total == len(run.scenario.trace)
    report = run.report
    # 1,000 req/s in full batches of 50 on 8 workers: 20 calls/s of 0.2 s = 4 of 8 workers busy
    assert report.busy_fraction == pytest.approx(0.5, abs=0.03)
    assert report.as_dict()["busy_fraction"] == report.busy_fraction
    assert run.as_dict()["scenario"]["policy"] == "size_or_timeout"


def test_linear_service_time_with_jitter_stays_within_its_bounds():
    model = linear(0.1, 0.002, jitter=0.1, seed=4)
    draws = np.array([model(50) for _ in range(2000)])
    assert draws.min() >= 0.2 * 0.9 and draws.max() <= 0.2 * 1.1
    assert abs(draws.mean() - 0.2) < 0.002
    assert linear(0.1, 0.002)(10) == pytest.approx(0.12)
    with pytest.raises(ValueError, match="jitter"):
        linear(0.1, jitter=1.5)


async def test_a_drop_time_that_rounds_early_still_drops(autojump_clock):
    # 0.9 - 0.2 + 0.2 < 0.9 in floats: a loop waking at 0.9 - 0.2 would find nothing to drop, forever
    fleet = Spawner(service=5.0)
    async with open_batcher(fleet, PoolConfig(workers=1), SlackDriven(50, service_time=0.2)) as batcher:
        await _ended_after_start(batcher)
        (late,) = await _ended(batcher, ["late"], timeout=0.9)
    assert isinstance(late.error, DeadlineUnreachable)
    assert late.finished_at == pytest.approx(0.7) and late.finished_at + 0.2 >= 0.9


async def _ended_after_start(batcher) -> None:
    """Keep the only worker busy (50 requests make a full batch at once)."""
    for text in map(str, range(50)):
        batcher.enqueue(batcher.request(text, "paid"))
    await trio.lowlevel.checkpoint()


def test_ferry_simulate_replays_a_csv_trace_and_writes_json(tmp_path, capsys):
    from gateway.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text(
        "timestamp,tier,deadline\n"
        + "".join(f"{i / 100:.2f},{'paid' if i % 2 else 'free'},\n" for i in range(300))
    )
    out = tmp_path / "run.json"
    argv = [
        "simulate",
        "--trace",
        str(trace),
        "--policy",
        "idle_aware",
        "--param",
        "reserve=2",
        "--workers",
        "4",
    ]
    assert main([*argv, "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "300 arrivals" in printed and "latency paid" in printed and "GPU busy" in printed
    run = json.loads(out.read_text())
    assert run["scenario"]["params"] == {"reserve": 2} and run["report"]["offered"] == 300
    assert run["report"]["completed"] == 300 and run["report"]["flushes"]["idle"] > 0


def test_ferry_simulate_refuses_a_bad_parameter_by_name(capsys):
    from gateway.cli import main

    assert main(["simulate", "--policy", "aimd", "--param", "backof=0.5", "--duration", "1", "--quiet"]) == 2
    assert "backof" in capsys.readouterr().err
