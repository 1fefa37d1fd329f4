"""Prefill and decode apart against colocated replicas, on real engines: what a stream of chats
sees when 3,000-token prompts arrive among them.

Over real HTTP, ``ferry serve`` with two SmolLM2-135M engines (float32, one torch thread each:
one core each on this 2-core machine), the same seeded open-loop stream for both layouts: chat
requests (Poisson arrivals, ``--chat-tokens`` streamed answer tokens each) and a 3,000-token
prompt every ``--flood-every`` seconds.

1. ``colocated``: ``workers = 2``; each replica prefills and decodes;
2. ``1 prefill + 1 decode``: ``prefill_workers = 1``, ``decode_workers = 1``; every sequence's
   KV moves from the prefill engine to the decode engine after its first token.

Reported per layout: the chat requests' TTFT p50/p95 (from the scheduled arrival), their TPOT
p50/p95/p99 (each served chat's time from first to last text over its output tokens less one),
the output tokens a second over the run, the long prompts served, and the hand-offs' bytes and
seconds a request from the gateway's ``/metrics`` (``ferry_engine_kv_handoff_bytes`` and
``_seconds``), and the mean of each part of a hand-off
(``ferry_engine_kv_handoff_phase_seconds``, ``batcher/continuous/handoff_phases.py``), with how
many engines ran with ``--kv-shm`` (from their command lines, by the pids of ``/readyz``).
Each layout stops by itself: ``--seconds`` of arrivals, each request given at most
``--seconds + --drain`` seconds. The gateways' logs go to ``results/``.

    python -m experiments.continuous_pd --seconds 60 --rate 1.0 --flood-every 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batcher.continuous.handoff_phases import PHASES
from experiments.common import markdown, plt, write
from experiments.continuous_long_prompts import percentile, phase, phase_arguments, serving

LAYOUTS = {"colocated": "workers = 2\n", "1 prefill + 1 decode": "prefill_workers = 1\ndecode_workers = 1\n"}
HANDOFF = ("ferry_engine_kv_handoff_bytes", "ferry_engine_kv_handoff_seconds")
PHASE = "ferry_engine_kv_handoff_phase_seconds"


def handoffs(url: str) -> dict[str, float]:
    """The hand-offs so far, from ``/metrics``: their count and mean bytes and seconds, and the
    mean seconds of each part (``phase <name>``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (*HANDOFF, PHASE):
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    key = sample.name + sample.labels.get("phase", "")
                    sums[key] = sums.get(key, 0.0) + sample.value
    count = sums.get(HANDOFF[0] + "_count", 0.0)
    parts = {f"phase {phase}": sums.get(f"{PHASE}_sum{phase}", 0.0) / counted
             for phase in PHASES if (counted := sums.get(f"{PHASE}_count{phase}", 0.0))}
    return {"count": count, "bytes": sums.get(HANDOFF[0] + "_sum", 0.0) / count if count else 0.0,
            "seconds": sums.get(HANDOFF[1] + "_sum", 0.0) / count if count else 0.0, **parts}


def kv_shm_engines(url: str) -> int:
    """How many of the gateway's engines run with ``--kv-shm``, by their command lines."""
    with urllib.request.urlopen(url + "/readyz", timeout=30) as response:
        ready = json.loads(response.read())
    pids: list[int] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            pids.extend(v for k, v in node.items() if k == "pid" and isinstance(v, int))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(ready)
    lines = [pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids]
    return sum(b"--kv-shm" in line for line in lines)


def tpot(chat: dict) -> float | None:
    """A served chat's time a token after its first: first to last text over the tokens between."""
    if not chat["ok"] or chat["output_tokens"] < 2 or chat["ttft"] is None:
        return None
    return (chat["last"] - chat["ttft"]) / (chat["output_tokens"] - 1)


def serve(layout: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], dict[str, float]]:
    """One layout's gateway, the seeded stream with its long prompts through it, and its hand-offs."""
    name = "pd" if "prefill" in layout else "colocated"
    with serving(LAYOUTS[layout], f"continuous_pd_{name}.log") as url:
        began = time.monotonic()
        chats, floods = asyncio.run(phase(url, args, True))
        elapsed = time.monotonic() - began
        moved = handoffs(url)
        shm = kv_shm_engines(url)
    return chats, floods, {**moved, "elapsed": elapsed, "kv-shm engines": shm}


def row(layout: str, chats: list[dict], floods: list[dict], moved: dict[str, float]) -> dict:
    ttft = [c["ttft"] for c in chats if c["ok"]]
    tpots = [t for t in map(tpot, chats) if t is not None]
    tokens = sum(a["output_tokens"] for a in chats + floods if a["ok"])
    return {
        "layout": layout,
        "chats served": f"{sum(c['ok'] for c in chats)} / {len(chats)}",
        "chat TTFT p50 ms": percentile(ttft, 50),
        "chat TTFT p95 ms": percentile(ttft, 95),
        "TPOT p50 ms": percentile(tpots, 50),
        "TPOT p95 ms": percentile(tpots, 95),
        "TPOT p99 ms": percentile(tpots, 99),
        "output tokens/s": round(tokens / moved["elapsed"], 1),
        "long prompts served": f"{sum(f['ok'] for f in floods)} / {len(floods)}",
        "hand-offs": int(moved["count"]),
        "MB a hand-off": round(moved["bytes"] / 1e6, 1),
        "ms a hand-off": round(moved["seconds"] * 1000, 1),
        "engines with --kv-shm": int(moved["kv-shm engines"]),
    }


def breakdown(moved: dict[str, float]) -> list[dict]:
    """The mean of each part of a hand-off, ms (``batcher/continuous/handoff_phases.py``)."""
    return [{"part": phase, "ms a hand-off": round(moved.get(f"phase {phase}", 0.0) * 1000, 1)}
            for phase in PHASES]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    phase_arguments(parser, seconds=60.0, chat_tokens=48, flood_every=15.0)  # a phase is one layout's run
    args = parser.parse_args(argv)
    began = time.monotonic()
    runs = {layout: serve(layout, args) for layout in LAYOUTS}
    rows = [row(layout, *run) for layout, run in runs.items()]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for layout, (chats, _, _) in runs.items():
        tpots = sorted(t * 1000 for t in map(tpot, chats) if t is not None)
        axis.plot(tpots, np.linspace(0, 1, len(tpots)), label=layout)
    axis.set_xlabel("chat TPOT, ms")
    axis.set_ylabel("share of chat requests")
    axis.legend()
    axis.set_title("SmolLM2 on CPU, chats among 3,000-token prompts")
    colocated, apart = rows
    summary = (
        f"Chat TPOT p95 is {apart['TPOT p95 ms']} ms with prefill and decode apart against "
        f"{colocated['TPOT p95 ms']} ms colocated (p99 {apart['TPOT p99 ms']} against "
        f"{colocated['TPOT p99 ms']}); chat TTFT p50 {apart['chat TTFT p50 ms']} against "
        f"{colocated['chat TTFT p50 ms']} ms; output {apart['output tokens/s']} against "
        f"{colocated['output tokens/s']} tokens/s; a hand-off moved {apart['MB a hand-off']} MB in "
        f"{apart['ms a hand-off']} ms on average. {time.monotonic() - began:.0f} s in all.\n\n"
        f"The parts of a hand-off, apart (mean over the hand-offs):\n\n"
        f"{markdown(breakdown(runs['1 prefill + 1 decode'][2]))}"
    )
    given = sys.argv[1:] if argv is None else argv
    write("continuous_pd", rows, figure, summary, "python -m experiments.continuous_pd " + " ".join(given))


if __name__ == "__main__":
    main()
