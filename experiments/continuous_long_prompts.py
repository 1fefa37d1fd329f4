"""The long-prompt pool: does a flood of 3,000-token prompts leave ordinary requests' TTFT alone?

Over real HTTP, ``ferry serve`` with two SmolLM2-135M engines (float32, one torch thread each:
one core each on this 2-core machine), in one run, three phases of the same seeded open-loop
chat stream (Poisson arrivals of short streamed requests):

1. ``alone``: the chat stream only, on a gateway with a long pool (1 ordinary + 1 long replica);
2. ``flood, long pool``: the same, plus a 3,000-token prompt every ``--flood-every`` seconds;
   long prompts go to the long replica (``long_prompt_tokens = 1024``);
3. ``flood, colocated``: the same two streams on a gateway whose two replicas are both
   ordinary (no long pool): the contrast.

Reported per phase: the chat requests' TTFT p50/p95 (from the scheduled arrival to the first
streamed text) and their ratio to phase 1's, and how many flood prompts were sent and served
(200, whole answer) with their TTFT, and why the others were not (status or error type). Each
phase stops by itself: ``--seconds`` of arrivals, each request given at most ``--seconds +
--drain`` seconds. The gateways' logs go to ``results/``. Nothing else should run on the machine meanwhile.

    python -m experiments.continuous_long_prompts --seconds 75 --rate 1.0 --flood-every 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import numpy as np

from batcher.sim.arrivals import poisson
from experiments.common import RESULTS, plt, write

KEY = "long-prompts-experiment"
MODEL = "smollm2@1"
LONG_PROMPT_TOKENS = 1024
TOPICS = ("the sea", "a ferry", "bread", "rain", "a library", "mountains", "the moon", "trains", "a garden",
          "winter", "a lighthouse", "coffee")
WORDS = ("harbour", "ticket", "engine", "deck", "tide", "gull", "rope", "cabin", "captain", "island", "storm",
         "cargo", "bridge", "anchor", "wave", "north", "lantern", "passenger", "timetable", "crossing")


def replicas(long_pool: bool) -> str:
    """Two SmolLM2 engines, one ordinary and one long, or two ordinary."""
    return (f"workers = 1\nlong_prompt_tokens = {LONG_PROMPT_TOKENS}\nlong_workers = 1\n" if long_pool
            else "workers = 2\n")


def gateway_file(replicas: str, state: str) -> str:
    """A gateway serving SmolLM2 (float32, a torch thread per engine) on the replicas ``replicas``
    declares (TOML lines of the model's table), one paid key."""
    return f"""
[server]
port = 0

[state]
dir = "{state}"

[[tiers]]
name = "paid"
wait_budget_ms = 120000

[[keys]]
key = "{KEY}"
tenant = "experiment"
tier = "paid"

[[models]]
name = "{MODEL}"
mode = "continuous"
model = "smollm2-135m"
threads = 1
num_blocks = 640
max_batch_tokens = 512
max_seqs = 32
temperature = 0.0
stats_timeout_ms = 120000
{replicas}"""


def start_gateway(path: pathlib.Path, log_name: str) -> tuple[subprocess.Popen, str]:
    """``ferry serve`` with the file at ``path``, its log in ``results/LOG_NAME``; returns once it
    listens (its engines are up)."""
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--config", str(path)]
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / log_name, "w") as log:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in process.stdout:  # type: ignore[union-attr]
        if "listening on http://" in line:
            return process, line.rsplit(" ", 1)[1].strip()
    raise SystemExit(f"ferry serve did not start (exit {process.wait()})")


def flood_prompt(index: int, tokens: int) -> str:
    """A long prompt of about ``tokens`` tokens, its own from the first word (no shared prefix
    for the cache to find beyond the chat template's)."""
    rng = random.Random(index)
    words = [f"Log {index}:"] + [rng.choice(WORDS) for _ in range(int(tokens * 0.95))]
    return "Summarise this log in one line. " + " ".join(words)


async def ask(session: aiohttp.ClientSession, url: str, content: str, max_tokens: int, due: float) -> dict:
    """One streamed chat request sent at ``due`` (loop time): its TTFT from ``due`` (to its first
    text, or to its end for an answer that is only an end-of-sequence), when its last text came
    (``last``), its prompt and output tokens, and whether it was served whole."""
    await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}],
            "stream": True, "stream_options": {"include_usage": True}}
    seen: dict = {"ttft": None, "last": None, "prompt_tokens": 0, "output_tokens": 0, "ok": False,
                  "failure": ""}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                seen["failure"] = str(response.status)
                return seen
            async for line in response.content:
                data = line.decode().strip().removeprefix("data: ")
                if not data or line.startswith(b":"):
                    continue
                if data == "[DONE]":  # served; an answer whose first token was its end has no text
                    if seen["ttft"] is None:
                        seen["ttft"] = asyncio.get_running_loop().time() - due
                    seen["ok"] = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    seen["failure"] = chunk["error"].get("type", "error")
                    return seen
                if chunk.get("usage"):
                    seen["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    seen["output_tokens"] = chunk["usage"]["completion_tokens"]
                text = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", ()))
                if text:
                    seen["last"] = asyncio.get_running_loop().time() - due
                    if seen["ttft"] is None:
                        seen["ttft"] = seen["last"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        seen["failure"] = type(exc).__name__
    return seen


async def phase(url: str, args: argparse.Namespace, flood: bool) -> tuple[list[dict], list[dict]]:
    """One phase: the seeded chat stream, and the flood if ``flood``; the answers of each."""
    timeout = aiohttp.ClientTimeout(total=args.seconds + args.drain)
    headers = {"x-api-key": KEY}
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        start = asyncio.get_running_loop().time() + 1.0
        chats = [ask(session, url, f"Write one line about {TOPICS[i % len(TOPICS)]}.", args.chat_tokens,
                     start + float(t)) for i, t in enumerate(poisson(args.rate, args.seconds, args.seed))]
        floods = [ask(session, url, flood_prompt(i, args.flood_tokens), 8, start + t)
                  for i, t in enumerate(np.arange(0.5, args.seconds, args.flood_every))] if flood else []
        answers = await asyncio.gather(*chats, *floods)
    return list(answers[: len(chats)]), list(answers[len(chats):])


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else float("nan")


def row(label: str, chats: list[dict], floods: list[dict], alone: float | None) -> dict:
    ttft = [c["ttft"] for c in chats if c["ok"]]
    flood_ttft = [f["ttft"] for f in floods if f["ok"]]
    p50 = percentile(ttft, 50)
    return {
        "phase": label,
        "chat requests": len(chats),
        "chat served": sum(c["ok"] for c in chats),
        "chat TTFT p50 ms": p50,
        "chat TTFT p95 ms": percentile(ttft, 95),
        "p50 vs alone": round(p50 / alone, 2) if alone else 1.0,
        "floods sent": len(floods),
        "floods served": sum(f["ok"] for f in floods),
        "not served (why)": " ".join(f"{why or 'cut short'} x{n}" for why, n in Counter(
            a["failure"] for a in chats + floods if not a["ok"]).items()) or "-",
        "flood prompt tokens": round(float(np.mean([f["prompt_tokens"] for f in floods if f["ok"]])))
        if flood_ttft else 0,
        "flood TTFT p50 ms": percentile(flood_ttft, 50),
    }


@contextlib.contextmanager
def serving(replicas: str, log_name: str) -> Iterator[str]:
    """A gateway on ``replicas`` (:func:`gateway_file`) while the block runs: its URL, after its
    engines' first steps. Its log: ``results/LOG_NAME``."""
    with tempfile.TemporaryDirectory(prefix="ferry-experiment-") as state:
        path = pathlib.Path(state) / "ferry.toml"
        path.write_text(gateway_file(replicas, state))
        process, url = start_gateway(path, log_name)
        try:
            asyncio.run(asyncio.sleep(3.0))  # the engines' first steps (allocations) before timing
            yield url
        finally:
            process.terminate()
            process.wait(60)


def serve_phases(replicas: str, log_name: str, args: argparse.Namespace, floods: tuple[bool, ...]
                 ) -> list[tuple[list[dict], list[dict]]]:
    """One :func:`phase` for each of ``floods`` (with the flood or without) on one gateway."""
    with serving(replicas, log_name) as url:
        return [asyncio.run(phase(url, args, flood)) for flood in floods]


def phase_arguments(parser: argparse.ArgumentParser, seconds: float, chat_tokens: int,
                    flood_every: float) -> None:
    """The options :func:`phase` reads, with an experiment's own defaults for the three that differ."""
    parser.add_argument("--seconds", type=float, default=seconds, help="arrivals per phase, seconds")
    parser.add_argument("--drain", type=float, default=90.0, help="at most this long after for answers")
    parser.add_argument("--rate", type=float, default=1.0, help="chat requests per second")
    parser.add_argument("--chat-tokens", type=int, default=chat_tokens, help="max_tokens of a chat request")
    parser.add_argument("--flood-every", type=float, default=flood_every, help="seconds between long prompts")
    parser.add_argument("--flood-tokens", type=int, default=3000, help="about this many tokens a long prompt")
    parser.add_argument("--seed", type=int, default=0)

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    phase_arguments(parser, seconds=75.0, chat_tokens=16, flood_every=20.0)
    args = parser.parse_args(argv)
    began = time.monotonic()
    (alone, with_pool) = serve_phases(replicas(True), "continuous_long_prompts_pool.log", args, (False, True))
    (colocated,) = serve_phases(replicas(False), "continuous_long_prompts_colocated.log", args, (True,))
    base = row("alone (1 ordinary + 1 long)", *alone, None)
    rows = [base, row("flood, long pool", *with_pool, base["chat TTFT p50 ms"]),
            row("flood, colocated (2 ordinary)", *colocated, base["chat TTFT p50 ms"])]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for label, (chats, _) in zip([r["phase"] for r in rows], (alone, with_pool, colocated), strict=True):
        ttft = sorted(c["ttft"] * 1000 for c in chats if c["ok"])
        axis.plot(ttft, np.linspace(0, 1, len(ttft)), label=label)
    axis.set_xlabel("chat TTFT, ms")
    axis.set_ylabel("share of chat requests")
    axis.set_xscale("log")
    axis.legend()
    axis.set_title("SmolLM2 on CPU, a 3,000-token prompt flood")
    pool, mixed = rows[1], rows[2]
    summary = (
        f"Chat TTFT p50 with the flood and a long pool is {pool['p50 vs alone']:.2f}x its TTFT alone "
        f"(p95 {pool['chat TTFT p95 ms']} ms against {base['chat TTFT p95 ms']} ms), and "
        f"{pool['floods served']} of {pool['floods sent']} flood prompts were served; colocated, the "
        f"same flood makes it {mixed['p50 vs alone']:.2f}x ({mixed['floods served']} of "
        f"{mixed['floods sent']} served). {time.monotonic() - began:.0f} s in all."
    )
    given = sys.argv[1:] if argv is None else argv
    command = "python -m experiments.continuous_long_prompts " + " ".join(given)
    write("continuous_long_prompts", rows, figure, summary, command)


if __name__ == "__main__":
    main()
