"""What the usage write-ahead costs a request: two real gateways side by side, one without it.

The write-ahead journals each usage record (one ``write`` of one JSON line) before the answer's
last bytes leave. To see its price, this starts two ``ferry serve`` processes on loopback with
the same config: this tree's, and another checkout's (``--before``, e.g. a worktree of the
commit before it). They take turns: slices of closed-loop whole requests to one, then the
other, so both see the same machine at the same moments. Per gateway it reports the p50 and p99
latency and the gateway process's CPU per request (its user + system time, workers excluded).

    git worktree add /tmp/before <commit>
    .venv/bin/python experiments/write_ahead_cost.py --before /tmp/before --slices 20

A second figure isolates the call itself: the microseconds ``UsageLog.record`` takes on the
request's thread, journaled against a writer without a journal, in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import aiohttp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.accounting.sqlite_writer import SqliteWriter  # noqa: E402
from gateway.accounting.usage import _INSERT, _ROW, _SCHEMA, UsageLog, UsageRecord  # noqa: E402

KEY = "sk-bench-0001"
CONFIG = f"""
[server]
host = "127.0.0.1"
port = 0

[[tiers]]
name = "paid"
wait_budget_ms = 10000

[[keys]]
key = "{KEY}"
tenant = "bench"
tier = "paid"

[[models]]
name = "echo@1"
aliases = ["echo"]
workers = 2
worker = ["echo"]
max_batch = 16
max_wait_ms = 1
"""


class Served:
    """One ``ferry serve`` from the checkout at ``tree``, with its own state directory."""

    def __init__(self, tree: pathlib.Path, scratch: pathlib.Path) -> None:
        scratch.mkdir(parents=True)
        config = scratch / "ferry.toml"
        config.write_text(CONFIG + f'\n[state]\ndir = "{scratch}"\n')
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=(scratch / "log").open("wb"), text=True)
        for line in self.process.stdout:  # type: ignore[union-attr]
            if "listening on http://" in line:
                self.url = "http://" + line.rsplit("http://", 1)[1].strip()
                break
        else:
            raise RuntimeError(
                f"ferry serve from {tree} did not start: {(scratch / 'log').read_text()[-2000:]}"
            )
        self.latencies: list[float] = []
        self.cpu = 0.0
        self.requests = 0

    def cpu_seconds(self) -> float:
        fields = pathlib.Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


async def slice_of(served: Served, session: aiohttp.ClientSession, seconds: float, clients: int) -> None:
    """Closed-loop whole requests from ``clients`` clients for ``seconds``."""
    end = time.monotonic() + seconds
    cpu = served.cpu_seconds()
    body = {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": "write ahead"}]}

    async def client() -> None:
        while time.monotonic() < end:
            began = time.monotonic()
            async with session.post(f"{served.url}/v1/messages", json=body) as reply:
                await reply.read()
                assert reply.status == 200, reply.status
            served.latencies.append(time.monotonic() - began)
            served.requests += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    served.cpu += served.cpu_seconds() - cpu


async def side_by_side(gateways: dict[str, Served], slices: int, seconds: float, clients: int) -> None:
    async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as session:
        for served in gateways.values():  # warm both: connections, workers, code paths
            await slice_of(served, session, 0.5, clients)
            served.latencies.clear()
            served.cpu = served.requests = 0
        for index in range(slices):
            order = list(gateways.values()) if index % 2 == 0 else list(gateways.values())[::-1]
            for served in order:
                await slice_of(served, session, seconds, clients)


def record_cost(rounds: int, per_round: int, scratch: pathlib.Path) -> dict[str, float]:
    """Microseconds per ``record`` on the caller's thread: journaled (the usage log) against the
    same writer without a journal, alternating rounds."""
    journaled = UsageLog(str(scratch / "journaled.sqlite"))
    plain = SqliteWriter(str(scratch / "plain.sqlite"), _SCHEMA, "plain-writer")
    spent = {"journaled": 0.0, "without": 0.0}
    count = 0
    for index in range(rounds):
        for name in (("journaled", "without") if index % 2 == 0 else ("without", "journaled")):
            records = [
                UsageRecord(
                    f"{name}-{index}-{i}",
                    time.time(),
                    "t",
                    "k",
                    "m@1",
                    10,
                    20,
                    0.01,
                    0.02,
                    200,
                    "end_turn",
                    "completed",
                )
                for i in range(per_round)
            ]
            began = time.perf_counter()
            for record in records:
                if name == "journaled":
                    journaled.record(record)
                else:
                    plain.put(_INSERT, _ROW(record))
            spent[name] += time.perf_counter() - began
        count += per_round
        time.sleep(0.06)  # a commit in between, as under real traffic
    journaled.close()
    plain.close()
    return {name: seconds / count * 1e6 for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--before", type=pathlib.Path, required=True, help="a checkout without the write-ahead"
    )
    parser.add_argument("--slices", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0, help="each slice's length")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferry-write-ahead-") as scratch:
        root = pathlib.Path(scratch)
        gateways = {
            "before": Served(args.before.resolve(), root / "before"),
            "after": Served(ROOT, root / "after"),
        }
        try:
            asyncio.run(side_by_side(gateways, args.slices, args.seconds, args.clients))
        finally:
            for served in gateways.values():
                served.stop()
        for name, served in gateways.items():
            p50, p99 = np.percentile(served.latencies, [50, 99]) * 1000
            print(f"{name:>6}: {served.requests} requests, p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
                  f"gateway CPU {served.cpu / served.requests * 1e6:.0f} µs per request")
        costs = record_cost(40, 500, root)
        print("UsageLog.record on the request's thread: "
              + ", ".join(f"{name} {micros:.1f} µs" for name, micros in costs.items()))


if __name__ == "__main__":
    main()
