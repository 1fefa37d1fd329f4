"""Continuous batching against static batches, the same model and the same workload, over HTTP.

One ``ferry serve`` serves SmolLM2-135M-Instruct twice, on this machine's CPU:

- ``smollm2-continuous@1``: ``mode = "continuous"``, one engine worker (paged KV cache, a token
  budget a step, sequences join and leave every step);
- ``smollm2-static@1``: ``mode = "fixed"``, one ``generate`` worker: each call one static batch
  of up to ``--max-batch`` prompts, prefilled together and decoded until its longest answer
  ends (the rest pad), run by the same engine runner (same weights, same kernels).

The same mixed workload goes to each in turn: ``--requests`` streamed greedy requests from a
fixed seed, ``max_tokens`` drawn from 16, 32 and 64, for each of ``--rates`` (Poisson arrivals
per second, or all at once for 0). Times are the client's (a static batch sends its whole answer
at once: its TTFT is its whole latency). Both run in ``--dtype`` (bfloat16 by default), one
torch thread a process (``OMP_NUM_THREADS=1`` unless set), and each (arrivals, mode) pair runs
``--repeat`` times, the modes alternating; the table shows medians, with the load average.
Why one thread, and the figures: experiments/docs/continuous-vs-static.md.

    .venv/bin/python -m experiments.continuous_vs_fixed --requests 24 --rates 0 2 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batcher.continuous.config import converted_dir
from experiments.common import RESULTS, markdown

KEY = "sk-bench-paid-0001"
MODES = (("continuous", "smollm2-continuous@1"), ("static batches", "smollm2-static@1"))
WORDS = [
    "ferry", "river", "pilot", "crossing", "morning", "fog", "deck", "cars", "bicycles", "winter", "spring",
    "trees", "hills", "tickets", "coins", "walker", "cart", "truck", "trailer", "bridge", "bank", "city",
]


def config(model_dir: str, max_batch: int, max_tokens: int, dtype: str) -> str:
    return f"""
[server]
port = 0
ping_interval_ms = 60000

[[tiers]]
name = "paid"
wait_budget_ms = 600000

[[keys]]
key = "{KEY}"
tenant = "bench"
tier = "paid"

[[models]]
name = "smollm2-continuous@1"
mode = "continuous"
model = "{model_dir}"
workers = 1
max_batch_tokens = 256
max_seqs = 32
kv_memory_gb = 0.5
dtype = "{dtype}"
stats_timeout_ms = 60000

[[models]]
name = "smollm2-static@1"
mode = "fixed"
workers = 1
worker = ["generate", "--model", "{model_dir}", "--max-tokens", "{max_tokens}", "--kv-memory-gb", "0.5",
          "--dtype", "{dtype}"]
max_batch = {max_batch}
max_wait_ms = 100
hang_timeout_ms = 600000
tokenizer = "{model_dir}"
chat_template = "model"
"""


def workload(requests: int, rate: float, seed: int) -> list[tuple[float, str, int]]:
    """(arrival, question, max_tokens) for each request: Poisson arrivals, mixed sizes."""
    rng = random.Random(seed)
    at, jobs = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate) if rate > 0 else 0.0
        words = rng.choice((4, 12, 40, 120))
        question = "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."
        jobs.append((at, question, rng.choice((16, 32, 64))))
    return jobs


async def one(session, url: str, model: str, question: str, max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    sent = time.monotonic()
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": question}]}
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta":
                last = time.monotonic()
                first = first or last
            elif event["type"] == "message_delta":
                tokens = event["usage"]["output_tokens"]
    return {"sent": sent, "first": first, "last": last, "done": time.monotonic(), "tokens": tokens}


async def phase(url: str, model: str, jobs) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await asyncio.gather(*(one(session, url, model, q, m, at) for at, q, m in jobs))


def summary(name: str, results: list[dict]) -> dict:
    ttft = [r["first"] - r["sent"] for r in results if r["first"]]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results if r["first"] and r["tokens"] > 1]
    e2e = [r["done"] - r["sent"] for r in results]
    span = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)

    def q(values, p):
        return (
            statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else values[0]
        )

    return {"mode": name, "requests": len(results), "output tokens": tokens, "tokens/s": tokens / span,
            "TTFT p50 ms": 1000 * q(ttft, 50), "TTFT p95 ms": 1000 * q(ttft, 95),
            "TPOT p50 ms": 1000 * q(tpot, 50), "TPOT p95 ms": 1000 * q(tpot, 95),
            "e2e p50 ms": 1000 * q(e2e, 50), "e2e p95 ms": 1000 * q(e2e, 95)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 2.0],
                        help="arrivals per second, one run each (0: all at once)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each pair; the table shows medians")
    parser.add_argument("--max-batch", type=int, default=8, help="the static batch's size limit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = converted_dir("smollm2-135m")
    subprocess.run([sys.executable, "-m", "workers.convert", "smollm2-135m", "--out", model_dir], check=True)
    longest = max(m for _, _, m in workload(args.requests, 1.0, args.seed))
    with tempfile.TemporaryDirectory() as state:
        path = Path(state) / "bench.toml"
        path.write_text(
            config(model_dir, args.max_batch, longest, args.dtype) + f'\n[state]\ndir = "{state}"\n'
        )
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # see the module doc
        server = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **threads})
        try:
            for line in server.stdout:  # type: ignore[union-attr]
                if "listening on http://" in line:
                    url = "http://" + line.rsplit("http://", 1)[1].strip()
                    break
            else:
                raise SystemExit("ferry serve did not start")
            load_before = os.getloadavg()[0]
            rows = []
            for rate in args.rates:
                jobs, arrivals = (
                    workload(args.requests, rate, args.seed),
                    f"{rate:g}/s" if rate else "all at once",
                )
                runs: dict[str, list[dict]] = {name: [] for name, _ in MODES}
                for _ in range(args.repeat):
                    for name, model in MODES:
                        started = time.monotonic()
                        runs[name].append(summary(name, asyncio.run(phase(url, model, jobs))))
                        print(
                            f"{arrivals}, {name}: {time.monotonic() - started:.1f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                for name, _ in MODES:
                    rows.append({"arrivals": arrivals, "mode": name, **{
                        column: statistics.median_low(run[column] for run in runs[name])
                        for column in runs[name][0] if column != "mode"}})
            load_after = os.getloadavg()[0]
        finally:
            server.terminate()
            server.wait(60)
    command = "python -m experiments.continuous_vs_fixed " + " ".join(sys.argv[1:])
    text = (
        f"# Continuous batching against static batches (SmolLM2-135M, CPU)\n\n`{command}`\n\n"
        f"Medians of {args.repeat} runs each; "
        f"load average {load_before:.2f} before, {load_after:.2f} after.\n\n"
        f"{markdown(rows)}\n"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "continuous_vs_fixed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
