"""A rollout under open-loop HTTP load: add a version, shift an alias, roll back, remove the old one.

    .venv/bin/python -m experiments.rollout --rate 1000 --stage 5

starts ``ferry serve`` on a file with one version (``ferry-large@1``, ``echo`` workers: the
work is the gateway's, not a model's) behind the alias ``ferry-large``, and sends Poisson
arrivals at ``--rate`` for the whole run, each request a new session (``metadata.user_id``), so
that the split over sessions is the split over requests. One stage every ``--stage`` seconds:

    v1 only ─reload─> +v2 at 0/100 ─SIGHUP─> 50/50 ─reload of a broken file (refused)─> still 50/50
            ─reload─> 100/0 ─`ferry weights` rollback─> 0/100 ─admin: weights─> 100/0
            ─reload─> v1 removed (drained, its workers stopped)

and checks what a rollout promises (docs/operations.md):

- every request is answered, once: one HTTP answer each, and one usage record per answer (the
  ``request-id`` header finds it in the usage table after the gateway stops), no id twice;
- at each stage the share of requests answered by v2 is within 2 points of its weight, counting
  the requests sent after the change was in force and answered before the next one began;
- the broken file changes nothing (the 50/50 split holds across it);
- the rollback's latency, from the moment ``ferry weights`` is started (a new process: Python's
  start-up included) to the last request the new version answered, and to the first request sent
  after it that the old one answered.

Reloads and weights go through the admin socket from this process (the CLI's own start-up would
be noise on a 2-core machine that also runs the gateway and the generator), except the rollback,
which is the real command. The generator's lag behind its schedule is reported: a generator that
falls behind offers less than ``--rate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from batcher.sim.arrivals import poisson
from experiments.generator_gc import collector_off
from experiments.http_load import process_cpu, start_gateway
from gateway.accounting.usage import read_usage
from gateway.http import event_loop

KEY = "sk-rollout-paid-01"
ALIAS = "ferry-large"
OLD, NEW = f"{ALIAS}@1", f"{ALIAS}@2"


def config(state: str, versions: list[str], weights: dict[str, float], broken: bool = False) -> str:
    models = "".join(
        f'[[models]]\nname = "{name}"\nworkers = 2\nworker = ["echo"]\nmax_batch = 50\nmax_wait_ms = 2\n'
        for name in versions)
    split = ", ".join(f'"{version}" = {weight}' for version, weight in weights.items())
    text = (f'[server]\nport = 0\nshutdown_grace_ms = 30000\n[state]\ndir = "{state}"\n'
            f'[[tiers]]\nname = "paid"\nwait_budget_ms = 5000\n'
            f'[[keys]]\nkey = "{KEY}"\ntenant = "rollout"\ntier = "paid"\n'
            f"{models}[aliases]\n{ALIAS} = {{ {split} }}\n")
    return text.replace("max_wait_ms = 2", "max_wait_ms = -2", 1) if broken else text


class Generator:
    """Poisson arrivals on schedule, whatever the server does; what each request got."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, rate: float, duration: float, seed: int
    ) -> None:
        self.session, self.url = session, url
        self.times = poisson(rate, duration, seed)
        self.sent: list[
            tuple[float, float, int, str, str]
        ] = []  # sent, answered, status, version, request id
        self.failed: dict[str, int] = {}
        self.lag = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05
        pending: set[asyncio.Task] = set()
        for index, offset in enumerate(self.times):
            scheduled = start + float(offset)
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.lag = max(self.lag, loop.time() - scheduled)
            task = asyncio.ensure_future(self._one(index))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)

    async def _one(self, index: int) -> None:
        body = (f'{{"model":"{ALIAS}","max_tokens":16,"messages":[{{"role":"user","content":"r{index}"}}],'
                f'"metadata":{{"user_id":"session-{index}"}}}}').encode()
        sent = time.monotonic()
        try:
            async with self.session.post(self.url, data=body) as reply:
                answer = await reply.read()
                status = reply.status
                request_id = reply.headers.get("request-id", "")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.failed[type(exc).__name__] = self.failed.get(type(exc).__name__, 0) + 1
            return
        version = json.loads(answer).get("model", "") if status == 200 else str(status)
        self.sent.append((sent, time.monotonic(), status, version, request_id))

    def share(self, start: float, end: float) -> tuple[int, float, float]:
        """Requests sent after ``start`` and answered before ``end``: how many, the new
        version's share of them, and their p99 latency (seconds, send to answer)."""
        counted = [
            (v, answered - sent) for sent, answered, _, v, _ in self.sent if sent >= start and answered <= end
        ]
        if not counted:
            return 0, float("nan"), float("nan")
        versions = [v for v, _ in counted]
        return (
            len(counted),
            versions.count(NEW) / len(counted),
            float(np.percentile([t for _, t in counted], 99)),
        )


class Admin:
    """The admin socket, from this process."""

    def __init__(self, state: pathlib.Path) -> None:
        token = (state / "admin.token").read_text().strip()
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(state / "admin.sock")),
                                             headers={"Authorization": f"Bearer {token}"})

    async def __call__(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self.session.request(method, f"http://admin{path}", json=body) as reply:
            return reply.status, await reply.json()


async def main(args: argparse.Namespace) -> int:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ferry-rollout-"))
    path = workdir / "ferry.toml"
    path.write_text(config(str(workdir), [OLD], {OLD: 1}))
    process, url = start_gateway(str(path))
    admin = Admin(workdir)
    steps: list[tuple[str, float, float, float | None]] = []  # stage, change began, in force, new weight
    marks: dict[str, float] = {}
    try:
        connector = aiohttp.TCPConnector(limit=0)
        headers = {"x-api-key": KEY, "content-type": "application/json"}
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            generator = Generator(session, f"{url}/v1/messages", args.rate, 8 * args.stage, args.seed)
            cpu_before = process_cpu(process.pid)
            load = asyncio.ensure_future(generator.run())

            async def reload(name: str, text: str, weight: float | None, expect: int = 200) -> None:
                path.write_text(text)
                began = time.monotonic()
                status, answer = await admin("POST", "/reload")
                assert status == expect, answer
                steps.append((name, began, time.monotonic(), weight))
                print(f"  {name}: {answer.get('result') or answer.get('error')}", file=sys.stderr, flush=True)

            state = str(workdir)
            steps.append(("v1 only", 0.0, 0.0, 0.0))
            await asyncio.sleep(args.stage)
            await reload("0/100", config(state, [OLD, NEW], {OLD: 1, NEW: 0}), 0.0)
            await asyncio.sleep(args.stage)
            path.write_text(config(state, [OLD, NEW], {OLD: 1, NEW: 1}))
            _, before = await admin("GET", "/status")
            began = time.monotonic()
            process.send_signal(signal.SIGHUP)
            while (await admin("GET", "/status"))[1]["result"]["last_reload"] == before["result"][
                "last_reload"
            ]:
                await asyncio.sleep(0.005)
            steps.append(("50/50 (SIGHUP)", began, time.monotonic(), 0.5))
            await asyncio.sleep(args.stage)
            await reload(
                "50/50, broken file refused",
                config(state, [OLD, NEW], {OLD: 0, NEW: 1}, broken=True),
                0.5,
                expect=400,
            )
            await asyncio.sleep(args.stage)
            await reload("100/0", config(state, [OLD, NEW], {OLD: 0, NEW: 1}), 1.0)
            await asyncio.sleep(args.stage)
            marks["rollback"] = began = time.monotonic()
            command = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway.cli",
                "weights",
                ALIAS,
                f"{OLD}=1",
                f"{NEW}=0",
                "--config",
                str(path),
                cwd=pathlib.Path(__file__).resolve().parent.parent,
                stdout=subprocess.DEVNULL,
            )
            await command.wait()
            marks["rollback command"] = time.monotonic() - began
            steps.append(("rollback (ferry weights)", began, time.monotonic(), 0.0))
            await asyncio.sleep(args.stage)
            marks["forward"] = began = time.monotonic()
            status, answer = await admin("POST", "/weights", {"alias": ALIAS, "weights": {NEW: 1}})
            assert status == 200, answer
            marks["weights over the socket"] = time.monotonic() - began
            steps.append(("100/0 again (admin socket)", began, time.monotonic(), 1.0))
            await asyncio.sleep(args.stage)
            await reload("v1 removed", config(state, [NEW], {NEW: 1}), 1.0)
            await load
            gateway_cpu = process_cpu(process.pid) - cpu_before
    finally:
        await admin.session.close()
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    return report(args, generator, steps, marks, gateway_cpu, workdir)


def report(args, generator: Generator, steps, marks, gateway_cpu: float, workdir: pathlib.Path) -> int:
    records = read_usage(str(workdir / "usage.sqlite"))
    ids = [request_id for *_, request_id in generator.sent]
    statuses: dict[int, int] = {}
    for _, _, status, _, _ in generator.sent:
        statuses[status] = statuses.get(status, 0) + 1
    once = sorted(ids) == sorted(r.request_id for r in records) and len(set(ids)) == len(ids)
    latency = np.percentile([a - s for s, a, *_ in generator.sent], [50, 99, 100])
    print(
        f"\n{len(generator.times):,} requests offered at {args.rate:,.0f}/s over {8 * args.stage:g} s; "
        f"answers by status {statuses}; transport failures {generator.failed or 'none'}; "
        f"generator lag {1000 * generator.lag:.1f} ms; latency p50 / p99 / max "
        f"{' / '.join(f'{1000 * x:.0f}' for x in latency)}"
        f" ms; gateway CPU {1000 * gateway_cpu / len(generator.times):.3f} "
        f"ms/request"
    )
    print(f"usage records {len(records):,}; one per answer, none twice: {once}\n")
    print("| stage | requests counted | v2 weight | v2 observed | off by | p99 |\n|---|---|---|---|---|---|")
    worst = 0.0
    for (name, _, in_force, weight), following in zip(steps, [*steps[1:], None], strict=False):
        end = following[1] if following else float("inf")
        count, share, p99 = generator.share(in_force, end)
        off = abs(share - weight) * 100
        worst = max(worst, off)
        print(f"| {name} | {count:,} | {100 * weight:.0f} % | {100 * share:.2f} % | {off:.2f} points | "
              f"{1000 * p99:.0f} ms |")
    start = marks["rollback"]
    after = [(sent, v) for sent, _, _, v, _ in generator.sent if start <= sent < marks["forward"]]
    last_new = max((sent for sent, v in after if v == NEW), default=start) - start
    first_old = min((sent for sent, v in after if v == OLD), default=float("nan")) - start
    print(
        f"\nrollback: `ferry weights` ran {1000 * marks['rollback command']:.0f} ms (process start to exit); "
        f"the last request the new version answered was sent {1000 * last_new:.0f} ms after the command "
        f"started, and a request sent {1000 * first_old:.0f} ms after it was the old version's; "
        f"the same change over the admin socket: {1000 * marks['weights over the socket']:.1f} ms"
    )
    ok = once and not generator.failed and set(statuses) == {200} and worst <= 2.0
    print(f"\n{'PASS' if ok else 'FAIL'}: every request answered once with one usage record, "
          f"split within 2 points at every stage (worst {worst:.2f})")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s")
    parser.add_argument("--stage", type=float, default=5.0, help="seconds per stage")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    with collector_off():  # the generator's pauses would be charged to the gateway as latency
        sys.exit(event_loop.run(main(arguments)))
