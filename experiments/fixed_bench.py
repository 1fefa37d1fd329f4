"""The fixed-batch scenario served by ferry and by Mosec, side by side in one run, in alternating order.

    .venv/bin/python -m experiments.fixed_bench                          # 1,000-2,000/s, two rounds
    .venv/bin/python -m experiments.fixed_bench --rates 2000 --rounds 3 --servers ferry-ahead mosec

Every server runs the reference worker (8 workers, a call of 1-50 inputs takes 200 ms at any size,
each input answered reversed) and flushes at 50 inputs or 150 ms: ferry as `make serve`'s
`ferry-fixed` (and `ferry-ahead`, the same with `dispatch_ahead_ms = 20`), Mosec 0.9.8 from its
own virtualenv (``--peers``). One open-loop client (Poisson arrivals, the same ones for every
server, each answer checked) offers each rate for ``--duration`` s; a round runs every server,
the next round runs them in the opposite order. Front CPU: ferry's gateway process, Mosec's Rust
front; all CPU: every process of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import sys
import tempfile

import aiohttp

from batcher.sim.arrivals import poisson
from batcher.sim.fixed.report import Latency
from experiments.common import markdown
from experiments.embeddings_bench import Server, cpu_of, free_port, started, tree
from experiments.generator_gc import collector_off
from experiments.http_load import fixed_only
from gateway.embedded_default import DEFAULT_TOML

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS = ROOT / "experiments" / "fixed_peers"
WORKERS, MAX_BATCH, WAIT_MS, P95_LIMIT, AHEAD_MS = 8, 50, 150, 0.500, 20
KEY = "sk-ferry-demo-paid"


def servers(port: int, peers: pathlib.Path, scratch: str) -> dict[str, Server]:
    base = f"http://127.0.0.1:{port}"
    plain = fixed_only(DEFAULT_TOML)
    configs = {"ferry": plain, "ferry-ahead": plain.replace(
        "max_attempts = 3", f"max_attempts = 3\ndispatch_ahead_ms = {AHEAD_MS}", 1)}
    assert "dispatch_ahead_ms" in configs["ferry-ahead"], "the embedded default's fixed model changed"
    found = {}
    for name, toml in configs.items():
        path = pathlib.Path(scratch) / f"{name}.toml"
        path.write_text(toml)
        found[name] = Server(
            name, [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--config", str(path)],
            f"{base}/v1/messages", message, f"{base}/readyz")
    found["mosec"] = Server(
        "mosec", [str(peers / "peer-mosec/bin/python"), str(PEERS / "mosec_server.py"), str(port),
                  str(WORKERS), str(MAX_BATCH), str(WAIT_MS)],
        f"{base}/inference", lambda text: {"input": f"User: {text}"}, f"{base}/")
    return found


def message(text: str) -> dict:
    return {"model": "ferry-fixed", "max_tokens": 64, "messages": [{"role": "user", "content": text}]}


def front_of(name: str, pids: list[int]) -> list[int]:
    """The processes that are not workers: ferry's gateway (the group's leader), Mosec's Rust front."""
    if name.startswith("ferry"):
        return pids[:1]
    return [pid for pid in pids if "python" not in os.path.basename(os.readlink(f"/proc/{pid}/exe"))]


async def batches(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(inputs, calls) flushed so far, from the server's Prometheus batch-size histogram."""
    async with session.get(url) as reply:
        text = await reply.text()
    totals = collections.Counter[str]()
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for part in ("sum", "count"):
            if name.split("{")[0].endswith(f"batch_size_{part}"):
                totals[part] += float(value.split()[0])
    return totals["sum"], totals["count"]


async def step(session: aiohttp.ClientSession, server: Server, rate: float, duration: float,
               front: list[int], everything: list[int], metrics: str) -> dict:
    times = poisson(rate, duration, seed=int(rate))
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    last = 0.0

    async def one(scheduled: float, text: str) -> None:
        nonlocal last
        try:
            async with session.post(server.url, json=server.body(text)) as reply:
                body = await reply.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            errors[type(exc).__name__] += 1
            return
        if reply.status != 200:
            errors[str(reply.status)] += 1
        elif f"User: {text}"[::-1].encode() not in body:
            errors["wrong answer"] += 1
        else:
            latencies.append((last := loop.time()) - scheduled)

    load = os.getloadavg()[0]
    inputs, calls = await batches(session, metrics)
    front_before, all_before = cpu_of(front), cpu_of(everything)
    start, tasks = loop.time() + 0.05, []
    with collector_off():  # its pauses would be charged to the server as latency
        for index, offset in enumerate(times):
            scheduled = start + float(offset)
            if (delay := scheduled - loop.time()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(scheduled, f"fox {index}")))
        _, unfinished = await asyncio.wait(tasks, timeout=30)
    for task in unfinished:
        task.cancel()
    if unfinished:
        errors["unfinished"] += len(unfinished)
    front_cpu, all_cpu = cpu_of(front) - front_before, cpu_of(everything) - all_before
    inputs_after, calls_after = await batches(session, metrics)
    latency, ok = Latency.of(latencies), len(latencies)
    return {"server": server.name, "offered/s": rate, "achieved/s": ok / (last - start) if ok else 0.0,
            "errors": ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none",
            "p50 ms": latency.p50 * 1000, "p95 ms": latency.p95 * 1000,
            "p99 ms": latency.p99 * 1000,
            "mean batch": (inputs_after - inputs) / max(calls_after - calls, 1),
            "front CPU µs/req": 1e6 * front_cpu / max(len(times), 1),
            "all CPU µs/req": 1e6 * all_cpu / max(len(times), 1),
            "load avg": load, "held": not errors and latency.p95 <= P95_LIMIT}


async def bench(server: Server, rates: list[float], duration: float, log: pathlib.Path) -> list[dict]:
    rows = []
    async with started(server, log) as process:
        everything = tree(process.pid)
        front = front_of(server.name, everything)
        metrics = server.health.rsplit("/", 1)[0] + "/metrics"
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(headers={"x-api-key": KEY}, timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            await step(session, server, 200, 1, front, everything, metrics)  # every worker's first calls
            for rate in rates:
                row = await step(session, server, rate, duration, front, everything, metrics)
                print(row, file=sys.stderr)
                rows.append(row)
                await asyncio.sleep(1.0)  # the queue drains between rates
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", default=["ferry", "ferry-ahead", "mosec"])
    parser.add_argument("--rates", nargs="+", type=float, default=[1000, 1600, 1900, 2000])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    parser.add_argument("--rounds", type=int, default=2, help="each later round in the opposite order")
    parser.add_argument("--peers", type=pathlib.Path, default=pathlib.Path("/tmp"),
                        help="where the peer's virtualenv peer-mosec is")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-fixed-bench-") as scratch:
        for round_ in range(1, args.rounds + 1):
            for name in args.servers if round_ % 2 else reversed(args.servers):
                server = servers(free_port(), args.peers, scratch)[name]
                log = pathlib.Path(scratch) / f"{name}.log"
                try:
                    rows += [{"round": round_, **row}
                             for row in asyncio.run(bench(server, args.rates, args.duration, log))]
                except (AssertionError, TimeoutError, OSError) as exc:  # a peer that cannot run here: say why
                    print(f"{name} did not run: {exc}\n{log.read_text()[-3000:]}", file=sys.stderr)
    print(markdown([{k: v for k, v in row.items() if k != "held"} for row in rows]) if rows else "no run")
    results = ROOT / "experiments" / "results"
    results.mkdir(exist_ok=True)
    (results / "fixed_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
