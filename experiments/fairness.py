"""Two paid tenants on one fixed-mode fleet: a light one alone, and beside a heavy one that floods.

    python -m experiments.fairness

The embedded default's fixed-mode model on 2 reference workers (200 ms a call, batches of up to 50:
capacity 500 requests/s), its admission and budgets (paid: 1 s), in virtual time (the production
batcher and admission, simulated workers under trio's MockClock, no HTTP). Tenant L offers 30
requests/s (Poisson), tenant H 900/s, both paid, for ``--duration`` seconds. Three cases in one run:
L alone; L and H as one tenant (one FIFO, what the tier did before fair shares); L and H as two
tenants of weight 1 (fair shares). Reported per case and tenant: answered, shed (529 at arrival or
after queueing) with their Retry-After, and the answered requests' latency.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import matplotlib.pyplot as plt
import numpy as np
import trio
import trio.testing

from batcher.core.errors import Overloaded
from batcher.fixed.batcher import open_batcher
from batcher.fixed.request import Request, RequestState
from batcher.sim.arrivals import poisson
from batcher.sim.fixed.workers import SimulatedWorker, constant
from experiments.burst import SERVICE, configured
from experiments.common import write
from gateway.config import parse_config

Arrival = tuple[float, str]  # (seconds from the start, tenant)


def arrivals(rates: dict[str, float], duration: float, seed: int) -> list[Arrival]:
    """Each tenant's Poisson arrivals, merged in time order."""
    merged = [(float(t), tenant) for n, (tenant, rate) in enumerate(rates.items())
              for t in poisson(rate, duration, seed + n)]
    return sorted(merged)


Served = list[tuple[str, Request]]  # (tenant, its request, ended)


def serve(shots: list[Arrival], label: Callable[[str], str], workers: int) -> Served:
    """Every arrival through the embedded default's fixed-mode batcher in virtual time; each request
    is queued as tenant ``label(tenant)``. Returns each tenant's requests, ended."""
    config = parse_config(configured(workers), "<fairness>")
    model, queue = config.models[0], config.queue()
    requests: Served = []

    async def run() -> None:
        ended = trio.Semaphore(0)

        def spawn(slot: int) -> SimulatedWorker:
            return SimulatedWorker(constant(SERVICE), record=False)

        async with open_batcher(spawn, model.pool_config(), model.batch_policy(), queue) as batcher:
            await batcher.answer("warm up", "paid")  # admission plans with the call time of answered calls
            start = trio.current_time()
            for at, tenant in shots:
                await trio.sleep_until(start + at)
                request = batcher.request("x", "paid", on_done=lambda _: ended.release(),
                                          tenant=label(tenant))
                requests.append((tenant, request))
                batcher.enqueue(request)
            for _ in shots:
                await ended.acquire()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return requests


def latencies(requests: Served, tenant: str) -> np.ndarray:
    """Milliseconds from arrival to answer of ``tenant``'s answered requests."""
    return np.array([r.finished_at - r.arrival for t, r in requests
                     if t == tenant and r.state is RequestState.DONE and r.finished_at is not None]) * 1000


def rows_of(case: str, requests: Served) -> list[dict]:
    rows = []
    for tenant in sorted({t for t, _ in requests}):
        mine = [r for t, r in requests if t == tenant]
        done = latencies(requests, tenant)
        shed = [r.error.retry_after for r in mine if isinstance(r.error, Overloaded)]
        rows.append({
            "case": case, "tenant": tenant, "offered": len(mine), "answered": len(done),
            "answered %": 100 * len(done) / len(mine), "shed": len(shed),
            "p50 ms": float(np.percentile(done, 50)) if len(done) else float("nan"),
            "p95 ms": float(np.percentile(done, 95)) if len(done) else float("nan"),
            "max ms": float(done.max()) if len(done) else float("nan"),
            "Retry-After p50 s": float(np.median(shed)) if shed else float("nan"),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--workers", type=int, default=2, help="reference workers (250 requests/s each)")
    parser.add_argument("--light", type=float, default=30.0, help="tenant L's requests/s")
    parser.add_argument("--heavy", type=float, default=900.0, help="tenant H's requests/s")
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args()
    alone = arrivals({"L": args.light}, args.duration, args.seed)
    both = arrivals({"L": args.light, "H": args.heavy}, args.duration, args.seed)
    cases = {
        "L alone": serve(alone, str, args.workers),
        "L beside H, one FIFO": serve(both, lambda tenant: "", args.workers),
        "L beside H, fair shares": serve(both, str, args.workers),
    }
    rows = [row for case, requests in cases.items() for row in rows_of(case, requests)]

    figure, axis = plt.subplots(figsize=(8, 4))
    for case, requests in cases.items():
        light = np.sort(latencies(requests, "L"))
        axis.plot(light, np.arange(1, len(light) + 1) / len(light), label=case)
    axis.set(xlabel="tenant L's latency, answered requests (ms)", ylabel="share of L's answered requests",
             title=f"tenant L ({args.light:g}/s) beside H ({args.heavy:g}/s) on {args.workers} workers")
    axis.grid(alpha=0.3)
    axis.legend()

    def cell(case: str, column: str) -> float:
        return next(r[column] for r in rows if r["case"] == case and r["tenant"] == "L")

    limit = 1.5 * cell("L alone", "p95 ms") + 100
    summary = f"""
Tenant L at {args.light:g}/s beside tenant H at {args.heavy:g}/s, both paid, on {args.workers} reference
workers ({args.workers * 250}/s), {args.duration:g} s of arrivals, in virtual time.

- **L alone**: {cell('L alone', 'answered %'):.1f} % answered, p95 {cell('L alone', 'p95 ms'):.0f} ms.
- **One FIFO** (the tier before fair shares): {cell('L beside H, one FIFO', 'answered %'):.1f} % of L
  answered, p95 {cell('L beside H, one FIFO', 'p95 ms'):.0f} ms.
- **Fair shares**: {cell('L beside H, fair shares', 'answered %'):.1f} % of L answered,
  p95 {cell('L beside H, fair shares', 'p95 ms'):.0f} ms (the acceptance bound, 1.5 x alone + 100 ms:
  {limit:.0f} ms); H shed with Retry-After (median in the table).
"""
    command = "python -m experiments.fairness"
    write("fairness", rows, figure, summary, command)


if __name__ == "__main__":
    main()
