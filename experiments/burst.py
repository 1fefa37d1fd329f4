"""A burst over HTTP: paid and free traffic at several times capacity against ``ferry serve``.

    .venv/bin/python -m experiments.burst --workers 2 --rate 1500 --paid-share 0.25 --duration 20

runs the embedded default (``--workers 8``: 2,000 requests/s) or the same with fewer workers
(2 workers: 500/s), so that "3x capacity" fits what one machine can generate and serve.
``--virtual`` runs the same arrivals through the same batcher and admission in virtual time
(simulated 200 ms workers under trio's MockClock, no HTTP): the scheduler's own answer in
seconds, without the noise of a 2-core machine serving and generating at once.

Open loop (Poisson arrivals, each request sent on schedule whatever the server does), two API
keys (the embedded default's paid and free demo keys), loopback only, bounded in count and time.
It checks what admission control promises (docs/admission.md, "Overload"):

- paid: p95 within 500 ms, no 529 while its own rate is under capacity;
- free: shed with 529 as the queue grows, each with a ``Retry-After``;
- each 529's Retry-After against the time the queue really took to drain: until every request
  admitted before the 529 had left the queue (dispatched: its answer time less one 200 ms call;
  or expired at its deadline: its own 529), less the 529's time;
- no admitted request waits longer than its tier's budget plus one service time.

Over HTTP the drain is measured twice. On the server's clock (``retry_after_vs_drain``): each
answer's ``request-id`` header finds its usage record, which says when the gateway took the
request in and when it finished it. On the client's clock (``..._client_clock``): send and
receive times, which add the generator's own delays on a busy machine (a 529 read 50 ms late
makes a 100 ms drain look half as long).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import json
import os
import re
import sys
import tempfile

import aiohttp
import numpy as np
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from batcher.core.errors import Overloaded
from batcher.fixed.batcher import open_batcher
from batcher.fixed.request import Request, RequestState
from batcher.sim.arrivals import poisson, tier_mix
from batcher.sim.fixed.replay import Replay
from batcher.sim.fixed.workers import SimulatedWorker, constant
from experiments.generator_gc import collector_off
from experiments.http_load import fixed_only, process_cpu, start_gateway
from gateway.accounting.usage import UsageRecord, read_usage
from gateway.config import default_config, parse_config
from gateway.embedded_default import DEFAULT_TOML

KEYS = {"paid": "sk-ferry-demo-paid", "free": "sk-ferry-demo-free"}
BUDGET = {tier.name: tier.wait_budget_ms / 1000 for tier in default_config().tiers}  # seconds
SERVICE = 0.2
AHEAD_SETTING = re.compile(r"^dispatch_ahead_ms = .*\n", re.MULTILINE)


@dataclasses.dataclass(slots=True)
class Shot:
    tier: str
    scheduled: float
    sent: float = 0.0
    answered: float = 0.0
    status: int = 0
    retry_after: float = 0.0  # seconds, from retry-after-ms
    expired: bool = False  # a 529 for a request that was queued, then passed its deadline
    request_id: str = ""  # from the request-id header: its usage record
    dispatched: float | None = None  # when its batch took it, where known (in virtual time)


async def fire(
    session: aiohttp.ClientSession, url: str, body: bytes, shots: list[Shot], timeout: float
) -> float:
    """Send every shot at its time; return the generator's worst lag behind the schedule."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.1
    pending: set[asyncio.Task] = set()
    lag = 0.0

    async def one(shot: Shot) -> None:
        shot.sent = loop.time()
        try:
            async with session.post(url, data=body, headers={"x-api-key": KEYS[shot.tier]}) as reply:
                answer = await reply.read()
                shot.status = reply.status
                shot.request_id = reply.headers.get("request-id", "")
                shot.retry_after = int(reply.headers.get("retry-after-ms", 0)) / 1000
                shot.expired = reply.status == 529 and b"not dispatched within" in answer
        except (TimeoutError, aiohttp.ClientError, OSError):
            shot.status = -1
        shot.answered = loop.time()

    for shot in shots:
        shot.scheduled += start
        delay = shot.scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, loop.time() - shot.scheduled)
        task = asyncio.ensure_future(one(shot))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending, timeout=timeout)
    return lag


def left_queue(shot: Shot, call: float) -> float | None:
    """When an admitted request left the queue: dispatched (when its batch took it, else its
    answer less one call, which is later by the wait in its worker's pipe) or expired."""
    if shot.status == 200:
        return shot.answered - call if shot.dispatched is None else shot.dispatched
    return shot.answered if shot.expired else None


def drain_errors(shots: list[Shot], call: float) -> np.ndarray:
    """For each 529 at admission: Retry-After / (the time the queue then really took to drain,
    i.e. until every request admitted before it had left the queue)."""
    served = sorted((s.sent, left) for s in shots if (left := left_queue(s, call)) is not None)
    sent = [t for t, _ in served]
    last_dispatch = np.maximum.accumulate([d for _, d in served]) if served else np.array([])
    ratios = []
    for shot in shots:
        if shot.status != 529 or shot.expired:
            continue
        ahead = bisect.bisect_left(sent, shot.answered)  # admitted before this refusal
        if ahead == 0:
            continue
        drained = last_dispatch[ahead - 1] - shot.answered
        if drained > 0.01:
            ratios.append(shot.retry_after / drained)
    return np.array(ratios)


def on_server_clock(shots: list[Shot], records: list[UsageRecord]) -> list[Shot]:
    """The shots the gateway recorded, with its own times: taken in, and finished."""
    by_id = {record.request_id: record for record in records}
    return [
        dataclasses.replace(shot, sent=record.recorded_at - record.total_s, answered=record.recorded_at)
        for shot in shots
        if (record := by_id.get(shot.request_id)) is not None
    ]


def drain_report(shots: list[Shot], call: float) -> dict:
    ratios = drain_errors(shots, call)
    if not len(ratios):
        return {}
    return {
        "529s_compared": len(ratios),
        "median_ratio": round(float(np.median(ratios)), 3),
        "within_25_percent": round(float(np.mean(np.abs(ratios - 1) <= 0.25)), 3),
        "p10_p90_ratio": [round(float(q), 3) for q in np.percentile(ratios, [10, 90])],
    }


def summarize(
    shots: list[Shot], lag: float, cpu: float | None, server: list[Shot] | None = None, call: float = SERVICE,
    ahead: float = 0.0,
) -> dict:
    """The report; ``server``: the same shots on the gateway's clock, where there is one, ``call``
    the service time the gateway measured (its recent call time), and ``ahead`` the model's
    dispatch ahead: a batch framed ahead may start that long after its requests' deadline."""
    report: dict = {"offered": len(shots), "generator_lag_ms": round(lag * 1000, 1)}
    for tier in ("paid", "free"):
        mine = [s for s in shots if s.tier == tier]
        ok = [s.answered - s.scheduled for s in mine if s.status == 200]
        statuses: dict[str, int] = {}
        for s in mine:
            label = "529 expired" if s.expired else str(s.status)
            statuses[label] = statuses.get(label, 0) + 1
        report[tier] = {
            "offered": len(mine),
            "statuses": statuses,
            "p50_ms": round(float(np.percentile(ok, 50)) * 1000) if ok else None,
            "p95_ms": round(float(np.percentile(ok, 95)) * 1000) if ok else None,
            "max_ms": round(max(ok) * 1000) if ok else None,
            "bound_ms": round((BUDGET[tier] + ahead + call) * 1000),  # budget, dispatch ahead, one call
        }
    if server is None:
        report["retry_after_vs_drain"] = drain_report(shots, call)
    else:
        report["retry_after_vs_drain"] = drain_report(server, call)
        report["retry_after_vs_drain_client_clock"] = drain_report(shots, call)
        for tier in ("paid", "free"):
            inside = [s.answered - s.sent for s in server if s.tier == tier and s.status == 200]
            report[tier]["max_in_gateway_ms"] = round(max(inside) * 1000) if inside else None
    if cpu is not None:
        report["gateway_cpu_ms_per_request"] = round(cpu * 1000 / len(shots), 3)
    return report


def schedule(args: argparse.Namespace) -> list[Shot]:
    times = poisson(args.rate, args.duration, args.seed)
    tiers = tier_mix(len(times), {"paid": args.paid_share, "free": 1 - args.paid_share}, args.seed)
    return [Shot(tier, float(t)) for t, tier in zip(times, tiers, strict=False)]


def configured(workers: int, state: str | None = None, ahead_ms: float | None = None) -> str:
    """The embedded default with ``workers`` workers (its usage records kept in ``state``, and
    its ``dispatch_ahead_ms`` set to ``ahead_ms`` where given)."""
    config = fixed_only(DEFAULT_TOML).replace("workers = 8", f"workers = {workers}")
    if ahead_ms is not None:
        config = AHEAD_SETTING.sub("", config).replace(
            "max_batch = 50", f"max_batch = 50\ndispatch_ahead_ms = {ahead_ms}", 1)
    return config + (f'\n[state]\ndir = "{state}"\n' if state else "")


def virtual(args: argparse.Namespace) -> dict:
    """The same burst through the embedded default's batcher in virtual time (no HTTP)."""
    config = parse_config(configured(args.workers, ahead_ms=args.dispatch_ahead_ms), "<burst>")
    model = config.models[0]
    shots = schedule(args)
    names = [tier.name for tier in config.tiers]
    queue = config.queue()
    by_arrival: dict[float, Shot] = {}
    left = [len(shots)]
    all_ended = trio.Event()

    def ended(request: Request) -> None:
        left[0] -= 1
        if not left[0]:
            all_ended.set()
        shot = by_arrival[request.arrival]
        shot.scheduled = shot.sent = request.arrival
        shot.answered = request.finished_at
        shot.dispatched = request.dispatched_at
        shot.status = 200 if request.state is RequestState.DONE else 529
        if isinstance(request.error, Overloaded):
            shot.retry_after = request.error.retry_after
            shot.expired = request.dispatched_at is None and request.finished_at > request.arrival

    async def run() -> None:
        start = trio.current_time() + 1.0
        times = np.array([s.scheduled for s in shots]) + start
        by_arrival.update(zip(times.tolist(), shots, strict=False))
        tier = np.array([names.index(s.tier) for s in shots])
        deadlines = times + np.array([queue.deadline(i) for i in tier])
        def spawn(slot):
            return SimulatedWorker(constant(SERVICE), record=False)

        async with open_batcher(spawn, model.pool_config(), model.batch_policy(), queue) as batcher:
            await batcher.answer("warm up", "paid")  # admission plans with the call time of answered calls
            batcher.feed(Replay(batcher, times, tier, names, deadlines, ended))
            await all_ended.wait()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return summarize(shots, 0.0, None, ahead=model.pool_config().dispatch_ahead)


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ferry-burst-") as scratch:  # its config and usage records
        return await burst(args, scratch)


async def burst(args: argparse.Namespace, scratch: str) -> dict:
    shots = schedule(args)
    config = os.path.join(scratch, "ferry.toml")
    with open(config, "w") as out:
        out.write(configured(args.workers, scratch, args.dispatch_ahead_ms))
    process, url = start_gateway(config)
    body = json.dumps({"model": "ferry-fixed", "max_tokens": 64,
                       "messages": [{"role": "user", "content": "the quick brown fox"}]}).encode()
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         headers={"content-type": "application/json"}) as session:
            # warm up: admission plans with the call time of answered calls
            for _ in range(3):
                async with session.post(
                    f"{url}/v1/messages", data=body, headers={"x-api-key": KEYS["paid"]}
                ) as r:
                    await r.read()
            cpu_before = process_cpu(process.pid)
            with collector_off():
                lag = await fire(session, f"{url}/v1/messages", body, shots, timeout=35)
            cpu = process_cpu(process.pid) - cpu_before
            async with session.get(f"{url}/readyz") as ready:
                call = (await ready.json())["models"]["ferry-fixed@1"]["call_seconds"]
            async with session.get(f"{url}/metrics") as scraped:
                over = waits_over_budget(await scraped.text())
    finally:
        process.terminate()
        process.wait(60)  # SIGTERM: the gateway flushes its usage records before it exits
    records = read_usage(os.path.join(scratch, "usage.sqlite"))
    model = parse_config(configured(args.workers, ahead_ms=args.dispatch_ahead_ms), "<burst>").models[0]
    ahead = model.pool_config().dispatch_ahead
    report = summarize(shots, lag, cpu, on_server_clock(shots, records), call, ahead)
    for tier, count in over.items():
        report[tier]["queue_waits_over_budget"] = count
    return report


def waits_over_budget(metrics: str) -> dict[str, int]:
    """Per tier, the requests the gateway's own queue-wait histogram counts as dispatched after
    their tier's wait budget (its buckets have a bound at each budget of the default)."""
    over = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "ferry_queue_wait_seconds":
            continue
        for tier, limit in BUDGET.items():
            within = [s.value for s in family.samples if s.labels.get("tier") == tier
                      and s.name.endswith("_bucket") and float(s.labels["le"]) == limit]
            total = [
                s.value for s in family.samples if s.labels.get("tier") == tier and s.name.endswith("_count")
            ]
            if within and total:
                over[tier] = int(total[0] - within[0])
    return over


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, default=8, help="sleep workers of 200 ms (capacity 250/s each)"
    )
    parser.add_argument("--rate", type=float, default=6000.0, help="offered requests/s, both tiers")
    parser.add_argument("--paid-share", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dispatch-ahead-ms", type=float, default=None,
                        help="the fixed model's dispatch_ahead_ms (default: the embedded default's)")
    parser.add_argument("--virtual", action="store_true", help="virtual time, no HTTP (see above)")
    parser.add_argument("--json", help="also write the report here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    result = virtual(arguments) if arguments.virtual else asyncio.run(main(arguments))
    print(json.dumps(result, indent=2))
    if arguments.json:
        with open(arguments.json, "w") as out:
            json.dump(result, out, indent=2)
    sys.exit(0)
