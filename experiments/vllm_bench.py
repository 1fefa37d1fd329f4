"""Side by side on SmolLM2-135M-Instruct (bfloat16): ferry's own engine, ferry scheduling vLLM's
engine (``engine = "vllm"``), and vLLM's own OpenAI server, one server at a time, alternating
round by round, the same prompts through each server's ``/v1/chat/completions``.

Each level of concurrency N runs N closed-loop clients, each sending ``--per-client`` streamed
greedy chat requests (``max_tokens`` answer tokens, a quarter of the prompts 300-450-word
documents, the rest short questions; ``stream_options.include_usage`` for the token count). A
row: answered (HTTP 200) and refused requests, output tokens per second over the level's wall
time, TTFT and TPOT (time per output token after the first) p50/p95, and the CPU seconds of the
serving front process per 1,000 output tokens (ferry's gateway, without its engine workers;
vLLM's API server process, whose engine core runs in a child). ``default`` is ``ferry serve``'s
embedded default (its demo key and wait budgets), to see what a burst does to it.

Loopback only. vLLM's side needs ``make vllm-env``. Both vLLM runs are eager (no torch.compile,
so that they start in seconds) unless ``--compile`` compiles both (vLLM's own default, slower to
start); either way they compare like with like. Every engine gets ``--threads`` CPU threads
(default: every core this process may use, as vLLM's server takes them). A server is stopped
with everything it started (vLLM's engine core can outlive its API server's exit), and the next
starts once the cores are quiet (what was left is logged on stderr). Figures:
experiments/docs/vllm.md::

    .venv/bin/python experiments/vllm_bench.py --levels 1 8 32 --per-client 2 --rounds 1
    .venv/bin/python experiments/vllm_bench.py --compile --levels 32 1 --per-client 1 --rounds 2
    .venv/bin/python experiments/vllm_bench.py --servers default --levels 32 --per-client 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time

import aiohttp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from experiments.http_load import process_cpu, start_gateway
from gateway.embedded_default import DEFAULT_TOML
from tests.support.vllm_server import VLLM_PYTHON, VllmOpenAIServer, vllm_installed
from workers.convert import ensure_converted
from workers.engine.config import WEIGHTS

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "sk-bench-0001"
SERVERS = ("ferry", "ferry+vllm", "vllm", "default")
WORDS = ("river ledger harbour engine signal quiet amber window orchard copper lantern meadow "
         "station ribbon falcon marble season thunder garden pocket").split()
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "How do bees make honey?", "Why is the sky blue?", "Give me a tip for sleeping well.",
             "What is a prime number?", "Describe a cat in one sentence.", "How far is the Moon?"]


def prompts(count: int, seed: int = 0) -> list[list[dict]]:
    """``count`` chat conversations, the same for every server: every fourth a document to sum up."""
    rng = random.Random(seed)
    chats = []
    for i in range(count):
        if i % 4 == 0:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 450)))
            content = f"Summarise this document in a few sentences:\n\n{text}"
        else:
            content = QUESTIONS[i % len(QUESTIONS)] + f" (question {i})"
        chats.append([{"role": "user", "content": content}])
    return chats


def ferry_config(model_dir: str, engine: str, state: str, threads: int, compiled: bool, weights: str) -> str:
    """A ferry configuration for the comparison: one SmolLM2 engine, budgets nobody waits past;
    ferry's engine with ``weights`` (bf16 or int8: its option for steps of few rows)."""
    vllm = f'python = "{VLLM_PYTHON}"\ncompile = {str(compiled).lower()}\n'
    own = vllm if engine == "vllm" else f'weights = "{weights}"\n'
    return f"""
[server]
port = 0

[[tiers]]
name = "paid"
wait_budget_ms = 600000

[[keys]]
key = "{KEY}"
tenant = "bench"
tier = "paid"

[[models]]
name = "smollm2@1"
mode = "continuous"
engine = "{engine}"
{own}model = "{model_dir}"
dtype = "bfloat16"
threads = {threads}
workers = 1
kv_memory_gb = 1.0
max_batch_tokens = 2048
context_window = 2048
stats_timeout_ms = 60000
temperature = 0.0

[state]
dir = "{state}"
"""


@dataclasses.dataclass
class Sample:
    status: int
    error: str = ""  # a refusal's message
    ttft: float = 0.0
    tpot: float = 0.0
    tokens: int = 0


async def one(session: aiohttp.ClientSession, url: str, model: str, key: str, chat: list,
              max_tokens: int) -> Sample:
    """One streamed chat completion: when its first text came, how fast the rest, how many tokens."""
    body = {"model": model, "messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status != 200:
            return Sample(response.status, error=(await response.text())[:200])
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the stream failed after its headers
                return Sample(200, error=chunk["error"].get("message", "")[:200])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                last = time.monotonic()
                first = first or last
    if first is None:
        return Sample(200, tokens=tokens)
    return Sample(200, ttft=first - started, tpot=(last - first) / max(1, tokens - 1), tokens=tokens)


async def level(url: str, model: str, key: str, chats: list, clients: int, per_client: int, max_tokens: int,
                pid: int) -> dict:
    """``clients`` closed-loop clients, ``per_client`` requests each: one row of the table."""
    queue = list(chats[: clients * per_client])
    samples: list[Sample] = []

    async def client(session):
        while queue:
            samples.append(await one(session, url, model, key, queue.pop(0), max_tokens))

    cpu = process_cpu(pid)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    wall, cpu = time.monotonic() - started, process_cpu(pid) - cpu
    ok = [s for s in samples if s.status == 200 and s.tokens]
    tokens = sum(s.tokens for s in ok)

    def pct(values, q):
        return round(float(np.percentile(values, q)) * 1000) if values else None

    refused = [s for s in samples if s not in ok]
    return {"clients": clients, "answered": len(ok), "refused": len(refused),
            "statuses": dict(collections.Counter(s.status for s in samples)),
            "first_refusal": refused[0].error if refused else "",
            "tok_s": round(tokens / wall, 1), "ttft_p50_ms": pct([s.ttft for s in ok], 50),
            "ttft_p95_ms": pct([s.ttft for s in ok], 95), "tpot_p50_ms": pct([s.tpot for s in ok], 50),
            "tpot_p95_ms": pct([s.tpot for s in ok], 95),
            "front_cpu_s_per_1k_tokens": round(cpu / tokens * 1000, 3) if tokens else None}


def start(server: str, model_dir: str, scratch: pathlib.Path, args: argparse.Namespace):
    """Start one server; returns (url, model name, key, its front process's pid, stop())."""
    if server == "vllm":
        peer = VllmOpenAIServer(model_dir, scratch / "vllm.log", kv_memory_gb=1, eager=not args.compile)
        peer.start()
        return peer.url, model_dir, "none", peer.process.pid, peer.stop
    path = scratch / f"{server}.toml"
    if server == "default":
        # The embedded default's relative paths are the checkout's; from a file they would be the file's.
        embedded = DEFAULT_TOML.replace('pythonpath = ["examples/', f'pythonpath = ["{ROOT}/examples/')
        path.write_text(embedded + f'\n[state]\ndir = "{scratch}"\n')
        model, key = "smollm2", "sk-ferry-demo-paid"
    else:
        engine = "vllm" if server == "ferry+vllm" else "ferry"
        path.write_text(ferry_config(model_dir, engine, str(scratch), args.threads, args.compile,
                                            args.weights))
        model, key = "smollm2@1", KEY
    process, url = start_gateway(str(path))

    def stop():
        process.terminate()
        process.wait(60)
    return url, model, key, process.pid, stop


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (vLLM's server forks its engine core, which forks compile
    workers), from the parent pids in ``/proc/*/stat``."""
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cpu_busy(window: float = 1.0) -> float:
    """The machine's busy fraction of all cores over ``window`` seconds (``/proc/stat``)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    total, idle = sample()
    time.sleep(window)
    total2, idle2 = sample()
    return 1 - (idle2 - idle) / max(1, total2 - total)


def _name(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def _cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds so far of each of ``pids`` still alive."""
    spent = {}
    for pid in pids:
        try:
            spent[pid] = process_cpu(pid)
        except OSError:
            pass
    return spent


def stop_quietly(server: str, pid: int, stop, quiet: float = 0.5, within: float = 30.0) -> dict:
    """Stop a server and everything it started, then wait (up to ``within`` s) until the cores are
    below ``quiet`` busy, so that the next server's round does not share them with the last one's
    leftovers. Returns what it found, for the log."""
    tree = descendants(pid)
    stop()
    leftover = sorted(p for p in tree if pathlib.Path(f"/proc/{p}").exists())
    names = collections.Counter(_name(p) for p in leftover)
    spent = _cpu(leftover)
    time.sleep(1.0)
    after = _cpu(leftover)  # CPU seconds the leftovers alive through that second burnt in it:
    spinning = sum(after[p] - spent[p] for p in after if p in spent)
    for child in leftover:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + within
    while any(pathlib.Path(f"/proc/{p}").exists() for p in leftover) and time.monotonic() < deadline:
        time.sleep(0.1)
    busy = [cpu_busy()]
    while busy[-1] > quiet and time.monotonic() < deadline:
        busy.append(cpu_busy())
    return {"stopped": server, "tree": len(tree), "left_over": dict(names),
            "left_over_cpu_s_per_s": round(spinning, 2), "left_over_alive_after_1_s": len(after),
            "busy_after_s": [round(b, 2) for b in busy]}


async def main(args: argparse.Namespace) -> list[dict]:
    model_dir = str(ensure_converted("smollm2-135m", log=lambda line: None))
    chats = prompts(max(args.levels) * args.per_client)
    rows = []
    for round_ in range(args.rounds):
        order = args.servers if round_ % 2 == 0 else list(reversed(args.servers))  # alternate who goes first
        for server in order:
            with tempfile.TemporaryDirectory(prefix=f"bench-{server.replace('+', '-')}-") as scratch:
                url, model, key, pid, stop = start(server, model_dir, pathlib.Path(scratch), args)
                try:
                    await level(url, model, key, chats, 1, 1, 8, pid)  # warm-up: first-call costs not in rows
                    for clients in args.levels:
                        measured = await level(url, model, key, chats, clients, args.per_client,
                                               args.max_tokens, pid)
                        row = {"round": round_, "server": server, **measured}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                finally:
                    print(json.dumps(stop_quietly(server, pid, stop)), file=sys.stderr, flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=["ferry", "ferry+vllm", "vllm"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients")
    parser.add_argument("--per-client", type=int, default=2, help="requests each client sends per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the servers, in alternating order")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--compile", action="store_true", help="both vLLM sides compiled (its default)")
    parser.add_argument("--weights", choices=WEIGHTS, default=WEIGHTS[0],
                        help="ferry's engine's weights (bf16, the default; int8 for steps of few rows)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU threads of each engine (default: every core this process may use)")
    args = parser.parse_args(argv)
    if any(s in ("ferry+vllm", "vllm") for s in args.servers) and not vllm_installed():
        parser.error("vLLM's virtualenv is not built: make vllm-env")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    table = asyncio.run(main(arguments))
    if arguments.json:
        pathlib.Path(arguments.json).write_text(json.dumps(table, indent=1))
