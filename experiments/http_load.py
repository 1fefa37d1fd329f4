"""Open-loop HTTP load against ``ferry serve``: Poisson arrivals, bounded in count and time.

Each request is sent at its scheduled arrival whatever the server is doing (an open loop, like a
crowd of independent clients), from this process's own aiohttp client, to 127.0.0.1 only.
Latency counts from the *scheduled* arrival, so a generator that falls behind makes the server
look slower, never faster; the report shows the generator's worst lag too.

With no ``--url`` it starts ``ferry serve --port 0`` itself (the embedded default's fixed model
unless ``--config``), and reads the gateway process's CPU time (``/proc/PID/stat``: user + system, all
of its threads, not its workers) before and after each run, to report CPU time per request.

    .venv/bin/python experiments/http_load.py --rate 1600 --duration 30
    .venv/bin/python experiments/http_load.py --rate 1600 1800 2000 --duration 30   # a sweep
    .venv/bin/python experiments/http_load.py --rate 1600 1900 --duration 10 --before /tmp/before --rounds 2

With ``--url`` it measures the processes named by ``--pid`` (several: a front and the core it
feeds, as ``experiments/front_batched.py`` prints them), added up and each on its own line.

``--before DIR`` compares two trees side by side: the gateway of ``DIR`` (an export of an earlier
commit: ``git archive REF | tar -x -C DIR``) and this tree's, each started fresh for every round,
alternating which goes first, against the same arrivals; each row names its tree.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from batcher.sim.arrivals import poisson
from batcher.sim.fixed.report import Latency
from experiments.generator_gc import collector_off
from gateway.embedded_default import DEFAULT_TOML
from gateway.http import event_loop

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    rate: float  # offered, per second
    duration: float
    offered: int
    ok: int
    achieved_rate: float  # 200s per second, first arrival to last answer
    latency: Latency  # of the 200s, seconds
    errors: dict[str, int]  # status or exception name -> count
    gateway_cpu_s: float | None  # every measured process together
    generator_cpu_s: float
    driver_lag_s: float
    cpu_by_pid: dict[int, float] = dataclasses.field(default_factory=dict)  # each measured process

    @property
    def cpu_per_request_ms(self) -> float | None:
        return None if self.gateway_cpu_s is None else 1000 * self.gateway_cpu_s / max(self.offered, 1)

    def held(self, p95_limit: float) -> bool:
        return not self.errors and self.latency.p95 <= p95_limit

    def row(self) -> str:
        ms = 1000
        t = self.latency
        cpu = "-" if self.cpu_per_request_ms is None else f"{self.cpu_per_request_ms:.3f}"
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        return (f"| {self.rate:,.0f} | {self.duration:g} s | {self.offered} | {self.achieved_rate:,.0f}/s | "
                f"{t.p50 * ms:.0f} | {t.p95 * ms:.0f} | {t.p99 * ms:.0f} | {errors} | {cpu} | "
                f"{self.generator_cpu_s * 1000 / max(self.offered, 1):.3f} | {self.driver_lag_s * ms:.1f} |")

    def by_process(self) -> str:
        """CPU ms per request of each measured process, when there are several."""
        offered = max(self.offered, 1)
        return ", ".join(f"pid {pid}: {1000 * cpu / offered:.3f}" for pid, cpu in self.cpu_by_pid.items())


HEADER = (
    "| offered/s | for | requests | achieved | p50 ms | p95 ms | p99 ms | errors | gateway CPU ms/req | "
    "generator CPU ms/req | driver lag ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (``/proc/PID/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_once(session: aiohttp.ClientSession, url: str, body: bytes, rate: float, duration: float,
                   timeout: float, seed: int, pids: list[int]) -> Run:
    times = poisson(rate, duration, seed)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    last_answer = 0.0
    lag = 0.0

    async def one(scheduled: float) -> None:
        nonlocal last_answer
        try:
            async with session.post(url, data=body) as reply:
                await reply.read()
                status = reply.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            errors[type(exc).__name__] += 1
            return
        now = loop.time()
        if status == 200:
            latencies.append(now - scheduled)
            last_answer = max(last_answer, now)
        else:
            errors[str(status)] += 1

    cpu_before = [process_cpu(pid) for pid in pids]
    own_before = own_cpu()
    start = loop.time() + 0.05
    pending: set[asyncio.Task] = set()  # finished tasks are dropped at once: a heap that grows
    for offset in times:  # with every request would make the generator's own pauses grow
        scheduled = start + float(offset)
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, loop.time() - scheduled)
        task = asyncio.ensure_future(one(scheduled))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        _, unfinished = await asyncio.wait(pending, timeout=timeout + 5)  # bounded in time as in count
        for task in unfinished:
            task.cancel()
        if unfinished:
            errors["unfinished"] += len(unfinished)
    spent = {pid: process_cpu(pid) - before for pid, before in zip(pids, cpu_before, strict=True)}
    span = last_answer - start if last_answer else float("nan")
    return Run(rate, duration, len(times), len(latencies), len(latencies) / span, Latency.of(latencies),
               dict(errors), sum(spent.values()) if pids else None, own_cpu() - own_before, lag, spent)


def fixed_only(toml: str) -> str:
    """A config without its continuous and embedding models: the fixed-mode figures are measured
    without a model loading and computing beside them on the same two cores."""
    head, *models = toml.split("\n[[models]]\n")
    kept = [m for m in models if 'mode = "continuous"' not in m and 'kind = "embedding"' not in m]
    return head + "".join(f"\n[[models]]\n{m}" for m in kept)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def start_gateway(config: str | None, root: pathlib.Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``ferry serve`` on a free port with ``config`` (a path), or the embedded default's fixed
    model, running the code of the tree at ``root`` (its modules first on the path)."""
    if config is None:
        scratch = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="ferry-fixed-", delete=False)
        with scratch:
            scratch.write(fixed_only(DEFAULT_TOML))
        config = scratch.name
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--config", config]
    process = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:  # type: ignore[union-attr]
        if "listening on http://" in line:
            return process, line.rsplit(" ", 1)[1].strip()
    raise SystemExit(f"ferry serve did not start (exit {process.wait()})")


async def main(args: argparse.Namespace) -> list[Run]:
    """Every rate against one gateway; with ``--before``, ``--rounds`` rounds of both trees."""
    if args.before is None:
        return await against(args, ROOT)
    trees = [(pathlib.Path(args.before).resolve(), "before"), (ROOT, "after")]
    runs = []
    for round_ in range(args.rounds):
        for root, name in trees if round_ % 2 == 0 else trees[::-1]:
            print(f"| round {round_ + 1}: {name} ({root}) |", flush=True)
            runs += await against(args, root)
    return runs


async def against(args: argparse.Namespace, root: pathlib.Path) -> list[Run]:
    """Every rate of ``args`` against the gateway at ``--url``, or one started from ``root``."""
    process = None
    url, pids = args.url, [int(pid) for pids in args.pid for pid in pids.split(",")]
    if url is None:
        process, url = start_gateway(args.config, root)
        pids = [process.pid]
    if aiohttp.client.URL(url).host not in LOOPBACK:
        raise SystemExit(f"--url: loopback only, got {url}")
    body = json.dumps({"model": args.model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "the quick brown fox"}]}).encode()
    headers = {"x-api-key": args.key, "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=args.connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    runs = []
    try:
        async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as session:
            for rate in args.rate:
                with collector_off():  # its pauses would be charged to the server as latency
                    run = await run_once(session, f"{url}/v1/messages", body, rate, args.duration,
                                         args.timeout, args.seed, pids)
                print(run.row(), flush=True)
                if len(pids) > 1:
                    print(f"CPU ms/req by process: {run.by_process()}", flush=True)
                runs.append(run)
                await asyncio.sleep(1.0)  # let the queues drain between rates
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate", type=float, nargs="+", default=[1600.0], help="requests/s; several: a sweep"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--url", help="a running gateway (loopback); default: start ferry serve here")
    parser.add_argument("--before", help="also a gateway from this tree, alternated with this one's")
    parser.add_argument("--rounds", type=int, default=1, help="with --before: rounds of both trees")
    parser.add_argument("--pid", action="append", default=[],
                        help="with --url: the gateway's pid, for its CPU time; several (repeated, or A,B): "
                             "their CPU added up, and shown each")
    parser.add_argument("--config", help="without --url: the config ferry serve starts with")
    parser.add_argument("--key", default="sk-ferry-demo-paid")
    parser.add_argument("--model", default="ferry-fixed")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a request may take")
    parser.add_argument("--connections", type=int, default=0, help="client connection cap; 0: none")
    parser.add_argument("--p95-ms", type=float, default=500.0, help="the latency a held rate keeps p95 under")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the runs here")
    args = parser.parse_args(argv)
    if args.before is not None and args.url is not None:
        parser.error("--before starts both gateways itself: no --url")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    print(HEADER, flush=True)
    results = event_loop.run(main(arguments))
    held = [run.rate for run in results if run.held(arguments.p95_ms / 1000)]
    print(f"highest rate held (p95 <= {arguments.p95_ms:g} ms, no errors): "
          f"{max(held):,.0f}/s" if held else "no rate held")
    if arguments.json:
        pathlib.Path(arguments.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(arguments.json).write_text(
            json.dumps([dataclasses.asdict(r) for r in results], indent=1)
        )
