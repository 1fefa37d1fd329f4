"""Local against Ray placement, side by side in one run: the data plane, the fixed sweep and the
continuous mode's TTFT and TPOT.

    python experiments/ray_placement.py                      # the full form (~3 min)
    python experiments/ray_placement.py --duration 4 --calls 300 --streams 8 --tokens 64   # short
    python experiments/ray_placement.py --parts fixed --rates 1800                         # one part

1. Data plane: one-input calls in a row to an echo worker, round trip by percentile: over the
   local pipe; over the TCP connection to a Ray-placed worker (what ferry uses); and as a Ray
   actor call to an actor that answers in-process (the other candidate).
2. Fixed sweep: 8 workers of 200 ms, Poisson arrivals at each rate, local then Ray placement:
   p50/p95/p99 latency and CPU per request (this process plus every worker's process tree:
   the actor host and its worker program for Ray).
3. Continuous: simulated engines (the llama-70b preset's step times), concurrent streams: time
   to first token and time per output token, local then Ray placement.

Ray runs as a private cluster on loopback that ferry starts itself (``address = "local"``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import EngineProcess
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling
from batcher.core.config import PoolConfig, QueueConfig, RayConfig
from batcher.fixed.batcher import open_batcher
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.policy import SizeOrTimeout
from batcher.fixed.worker import ProcessWorker
from batcher.placement.ray_actors import CLUSTER, use_cluster
from batcher.placement.spawn import placed
from batcher.sim.arrivals import poisson, tier_mix
from batcher.sim.fixed.load import drive
from batcher.sim.fixed.report import summarize
from gateway.text.tokenizer import ByteTokenizer
from workers.protocol import RunBatch

TICKS = os.sysconf("SC_CLK_TCK")
PARTS = ["data", "fixed", "continuous"]


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and of its live children, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICKS
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return seconds + sum(tree_cpu(int(child)) for child in children.read().split())
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def percentiles(seconds: list[float], scale: float = 1e3) -> str:
    p50, p95, p99 = np.percentile(seconds, (50, 95, 99)) * scale
    return f"{p50:8.2f} {p95:8.2f} {p99:8.2f}"


def model(placement: str, **fields) -> FixedModelConfig:
    return FixedModelConfig(name=f"bench-{placement}@1", placement=placement, **fields)


async def data_plane(calls: int) -> None:
    print(f"\n1. data plane: {calls} one-input calls in a row, round trip ms     p50      p95      p99")
    for placement in ("local", "ray"):
        echo = model(placement, worker=("echo",), workers=1)
        worker = placed(echo, echo.worker, ProcessWorker)(0)
        await worker.start()
        try:
            times = []
            for index in range(calls):
                started = time.perf_counter()
                await worker.call(RunBatch(index, ["hello"]))
                times.append(time.perf_counter() - started)
        finally:
            await worker.stop()
        label = "pipe to a local process" if placement == "local" else "TCP frames to a Ray-placed worker"
        print(f"   {label:<52}{percentiles(times)}")
    times = await trio.to_thread.run_sync(actor_calls, calls)
    print(f"   {'Ray actor call, answered in the actor':<52}{percentiles(times)}")


def actor_calls(calls: int) -> list[float]:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
    class Echo:
        def run_batch(self, inputs: list[str]) -> list[str]:
            return inputs

    actor = Echo.remote()
    ray.get(actor.run_batch.remote(["warm"]))
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        ray.get(actor.run_batch.remote(["hello"]))
        times.append(time.perf_counter() - started)
    ray.kill(actor)
    return times


async def fixed_sweep(rates: list[float], duration: float) -> None:
    print(f"\n2. fixed sweep: 8 x 200 ms workers, {duration:.0f} s of Poisson arrivals")
    print("   placement  rate/s  achieved  errors   p50 ms   p95 ms   p99 ms  CPU ms/request")
    for rate in rates:
        for placement in ("local", "ray"):
            sleepy = model(placement, worker=("sleep", "--latency-ms", "200"), workers=8)
            spawn = placed(sleepy, sleepy.worker, ProcessWorker)
            times = poisson(rate, duration, 0)
            tiers = tier_mix(len(times), {"paid": 0.5, "free": 0.5}, 0)
            async with open_batcher(spawn, PoolConfig(workers=8), SizeOrTimeout(50, 0.15)) as batcher:
                pids = [w.pid for w in batcher.pool.workers()]
                cpu = time.process_time() + sum(map(tree_cpu, pids))
                requests, lag = await drive(batcher, times, tiers)
                cpu = time.process_time() + sum(map(tree_cpu, pids)) - cpu
            report = summarize(requests, ("paid", "free"), batcher.counters, lag, 8)
            latency = report.latency
            print(f"   {placement:<9}{rate:8.0f}{report.achieved_rate:10.0f}{sum(report.errors.values()):8d}"
                  f"{latency.p50 * 1e3:9.1f}{latency.p95 * 1e3:9.1f}{latency.p99 * 1e3:9.1f}"
                  f"{cpu / len(requests) * 1e3:16.3f}")


async def continuous(streams: int, tokens: int) -> None:
    print(f"\n3. continuous: 2 simulated engines, {streams} streams of {tokens} tokens at once")
    print("   placement  TTFT ms: p50      p95      p99   TPOT ms: p50      p95      p99")
    for placement in ("local", "ray"):
        config = ContinuousModelConfig(name=f"bench-{placement}@1", simulated="llama-70b", workers=2,
                                       placement=placement, num_blocks=512, max_batch_tokens=256, max_seqs=64)
        spawn = placed(config, [*config.engine_argv(), "--sim-eos-prob", "0"], EngineProcess)
        ttft, tpot = [], []
        queue = QueueConfig(wait_budgets=(30.0, 30.0))
        async with open_engine_pool(config, queue, spawn, ByteTokenizer()) as pool:
            async with trio.open_nursery() as nursery:
                for index in range(streams):
                    nursery.start_soon(one_stream, pool, index, tokens, ttft, tpot)
        print(f"   {placement:<11}{percentiles(ttft):>24}{percentiles(tpot):>28}")


async def one_stream(pool, index: int, tokens: int, ttft: list[float], tpot: list[float]) -> None:
    prompt = bytes((index * 7 + i) % 90 + 32 for i in range(32))
    done, times = trio.Event(), []

    def on_event(event) -> None:
        if isinstance(event, Delta):
            times.append(time.perf_counter())
        if isinstance(event, Finished | Failed):
            done.set()

    started = time.perf_counter()
    pool.submit(Job(prompt.decode(), tuple(prompt), Sampling(tokens), "paid", "bench", stream=True), on_event)
    await done.wait()
    ttft.append(times[0] - started)
    tpot.append((times[-1] - times[0]) / max(1, len(times) - 1))


async def run(args: argparse.Namespace) -> None:
    use_cluster(RayConfig(address="local"))
    started = time.perf_counter()
    await trio.to_thread.run_sync(CLUSTER.join, "benchmark")
    print(f"a private Ray cluster on loopback started in {time.perf_counter() - started:.1f} s")
    if "data" in args.parts:
        await data_plane(args.calls)
    if "fixed" in args.parts:
        await fixed_sweep(args.rates, args.duration)
    if "continuous" in args.parts:
        await continuous(args.streams, args.tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000.0, 1800.0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per sweep point")
    parser.add_argument("--calls", type=int, default=1000, help="calls in a row for the data plane")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="run only these parts")
    trio.run(run, parser.parse_args())
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
