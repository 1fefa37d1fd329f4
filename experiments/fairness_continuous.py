"""A light tenant's TTFT beside a heavy one on the embedded SmolLM2 engine, over HTTP.

    python -m experiments.fairness_continuous --seconds 40
    python -m experiments.fairness_continuous --seconds 40 --tpot-target-ms 60 \
        --step-costs experiments/step_costs/smollm2-135m-bf16-cpu.json

``ferry serve`` with the embedded default's SmolLM2 model alone (one CPU engine) and its paid
tier, three keys: tenant L, tenant H, and a second key of tenant H. Tenant L sends one streamed
request every 2 s (a short question, 16 tokens of answer). Three phases of ``--seconds`` each, in
one run on one server: L alone; L beside H, which keeps ``--inflight`` long requests (256 tokens of
answer) in flight, resending each as it ends (after its Retry-After on a 529); and the same with
L's requests sent with H's second key, so that they share H's FIFO (the tier before fair shares).
Reported: L's TTFT p50/p95 and answered share in each phase, H's answered requests and tokens/s.
With ``--tpot-target-ms`` the paid tier promises that time per output token, held by the engine
with the step costs ``ferry fit`` measured (``--step-costs``): it seats no more sequences than
keep a decode step within it, and a tenant under its share of the seats takes one from the
tenant furthest over it (workers/engine/seats.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import tempfile
import time

import aiohttp
import numpy as np

from experiments.common import markdown
from experiments.http_load import start_gateway
from gateway.embedded_default import DEFAULT_TOML

STEP_COSTS = "experiments/step_costs/smollm2-135m-bf16-cpu.json"  # ferry fit, this machine
KEYS = {"L": "sk-fair-light-0001", "H": "sk-fair-heavy-0001", "H as L": "sk-fair-heavy-0002"}
LIGHT = {"content": "What is the capital of France?", "max_tokens": 16}
HEAVY = {"content": "Write a long story about a ship that crosses the sea. " * 8, "max_tokens": 256}


def config(state: str, tpot_target_ms: float = 0.0, step_costs: str = "") -> str:
    """The embedded default's tiers and SmolLM2 model alone, with the three keys; the paid tier's
    TPOT target and the model's step costs when given."""
    head, *models = DEFAULT_TOML.split("\n[[models]]\n")
    head = head.split("\n[[keys]]\n")[0]
    smollm2 = next(m for m in models if 'mode = "continuous"' in m)
    if tpot_target_ms:
        paid = 'name = "paid"\n'
        head = head.replace(paid, f"{paid}tpot_target_ms = {tpot_target_ms:g}\n", 1)
        smollm2 += f'step_costs = "{os.path.abspath(step_costs)}"\n'
    keys = "".join(f'\n[[keys]]\nkey = "{key}"\ntenant = "{name[0]}"\ntier = "paid"\n'
                   for name, key in KEYS.items())
    return f'{head}{keys}\n[[models]]\n{smollm2}\n[state]\ndir = "{state}"\n'


async def stream(session: aiohttp.ClientSession, url: str, key: str,
                 ask: dict) -> tuple[int, float, float, int]:
    """One streamed message: its status, TTFT (s), Retry-After (s, on a 529) and tokens."""
    body = {"model": "smollm2", "max_tokens": ask["max_tokens"], "stream": True,
            "messages": [{"role": "user", "content": ask["content"]}]}
    started = time.monotonic()
    async with session.post(url + "/v1/messages", json=body, headers={"x-api-key": key}) as response:
        if response.status != 200:
            await response.read()
            return response.status, 0.0, int(response.headers.get("retry-after-ms", 1000)) / 1000, 0
        first, tokens = 0.0, 0
        async for line in response.content:
            if line.startswith(b"data: ") and b"content_block_delta" in line:
                first = first or time.monotonic() - started
            if line.startswith(b"data: ") and b"message_delta" in line:
                tokens = json.loads(line[6:])["usage"]["output_tokens"]
        return 200, first, 0.0, tokens


async def phase(url: str, seconds: float, light_key: str, inflight: int) -> dict:
    """L every 2 s for ``seconds``, beside ``inflight`` heavy loops (none: L alone)."""
    light: list[tuple[int, float]] = []
    heavy: list[int] = []
    stop = time.monotonic() + seconds

    async def heavy_loop(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            status, _, retry, tokens = await stream(session, url, KEYS["H"], HEAVY)
            heavy.append(tokens)
            if status != 200:
                await asyncio.sleep(retry)

    async def light_one(session: aiohttp.ClientSession, delay: float) -> None:
        await asyncio.sleep(delay)
        status, ttft, _, _ = await stream(session, url, light_key, LIGHT)
        light.append((status, ttft))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        loops = [asyncio.create_task(heavy_loop(session)) for _ in range(inflight)]
        if inflight:
            await asyncio.sleep(5.0)  # H's loops reach their steady state first
        began = time.monotonic()
        await asyncio.gather(*(light_one(session, 2.0 * n) for n in range(int(seconds / 2))))
        wall = time.monotonic() - began
        await asyncio.gather(*loops)
    ttfts = [t for status, t in light if status == 200] or [float("nan")]
    return {"L answered %": 100 * sum(s == 200 for s, _ in light) / len(light),
            "L TTFT p50 ms": float(np.percentile(ttfts, 50) * 1000),
            "L TTFT p95 ms": float(np.percentile(ttfts, 95) * 1000),
            "H answered": sum(1 for t in heavy if t), "H tok/s": sum(heavy) / wall if inflight else 0.0}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ferry-fairness-") as scratch:
        path = pathlib.Path(scratch) / "ferry.toml"
        path.write_text(config(scratch, args.tpot_target_ms, args.step_costs))
        process, url = start_gateway(str(path))
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(3):  # warm up: the model's first steps
                    await stream(session, url, KEYS["L"], LIGHT)
            rows = []
            cases = [("L alone", KEYS["L"], 0), ("L beside H, fair shares", KEYS["L"], args.inflight),
                     ("L beside H, one FIFO (L as H)", KEYS["H as L"], args.inflight)]
            for case, key, inflight in cases:
                rows.append({"case": case, **await phase(url, args.seconds, key, inflight)})
                print(rows[-1], flush=True)
        finally:
            process.terminate()
            process.wait(60)
    target = (f" --tpot-target-ms {args.tpot_target_ms:g} --step-costs {args.step_costs}"
              if args.tpot_target_ms else "")
    print(f"\n```sh\npython -m experiments.fairness_continuous --seconds {args.seconds:g}{target}\n```\n")
    print(markdown(rows))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of each phase")
    parser.add_argument("--inflight", type=int, default=24, help="H's requests in flight")
    parser.add_argument("--tpot-target-ms", type=float, default=0.0, help="the paid tier's (0: none)")
    parser.add_argument("--step-costs", default=STEP_COSTS, help="`ferry fit`'s file for the target")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
