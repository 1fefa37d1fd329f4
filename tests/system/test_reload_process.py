"""Live reconfiguration of a real ``ferry serve`` under load, through ``ferry reload``, SIGHUP,
``ferry weights``, ``ferry drain`` and ``ferry status``: a version added, weights shifted, the old
version removed while requests (and a stream) run, a broken file refused with start-up's message,
and a rollback; every request answered exactly once, with one usage record each."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp

from gateway.accounting.usage import read_usage
from gateway.ops import control
from tests.support.gateway_process import PAID, ROOT, Gateway, ferry
from tests.support.processes import gone
from tests.support.waiting import until, until_asyncio

HEAD = f"""
[server]
host = "127.0.0.1"
port = 0
ping_interval_ms = 100

[[tiers]]
name = "paid"
wait_budget_ms = 10000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"
"""


def config(versions: dict[str, list[str]], weights: dict[str, float], alias: str = "fast") -> str:
    models = "".join(
        f'[[models]]\nname = "{name}"\nworkers = 1\nworker = {json.dumps(argv)}\nmax_wait_ms = 2\n'
        "hang_timeout_ms = 10000\n"
        for name, argv in versions.items()
    )
    split = ", ".join(f'"{v}" = {w}' for v, w in weights.items())
    return HEAD + models + f"[aliases]\n{alias} = {{ {split} }}\n"


def write(gateway: Gateway, text: str) -> None:
    gateway.config_path.write_text(text + f'[state]\ndir = "{gateway.tmp}"\n')


def admin(gateway: Gateway, method: str, path: str, body: dict | None = None) -> dict:
    args = argparse.Namespace(config=str(gateway.config_path), socket=None, timeout=60.0, command="test")
    status, answer = control.call(args, method, path, body)
    assert status == 200, answer
    return answer["result"]


SAMPLE = 30  # answers a stage of the rollout is judged on (a 50/50 split shows both versions in it)


class Load:
    """Open-loop requests to an alias, each with its own session, until stopped: what each got."""

    def __init__(self, gateway: Gateway, alias: str, rate: float) -> None:
        self.gateway, self.alias, self.rate = gateway, alias, rate
        self.results: list[
            tuple[float, float, int, str, str]
        ] = []  # sent, answered, status, version, request id
        self.running = True

    async def run(self) -> None:
        async with aiohttp.ClientSession(headers={"x-api-key": PAID}) as session:
            tasks, index = [], 0
            while self.running:
                tasks.append(asyncio.ensure_future(self._one(session, index)))
                index += 1
                await asyncio.sleep(1 / self.rate)  # the load's pace: open loop, ``rate`` a second
            await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession, index: int) -> None:
        body = {"model": self.alias, "max_tokens": 50, "messages": [{"role": "user", "content": f"r{index}"}],
                "metadata": {"user_id": f"user-{index}"}}
        sent = time.monotonic()
        async with session.post(f"{self.gateway.url}/v1/messages", json=body) as reply:
            answer = await reply.json()
            self.results.append((sent, time.monotonic(), reply.status, answer.get("model", ""),
                                 reply.headers.get("request-id", "")))

    def between(self, start: float, end: float) -> set[str]:
        """The versions that answered requests sent after ``start`` and answered before ``end``."""
        return {
            version for sent, answered, _, version, _ in self.results if sent >= start and answered <= end
        }

    async def answered_since(self, start: float, count: int = SAMPLE) -> None:
        """Until ``count`` requests sent after ``start`` have their answers: a sample of a stage."""
        await until_asyncio(lambda: sum(sent >= start for sent, *_ in self.results) >= count,
                            f"{count} answers to requests sent after the stage began")


async def step(gateway: Gateway, *args: str) -> tuple[float, subprocess.CompletedProcess, float]:
    """Run ``ferry ARGS`` without stopping the load; when it began, what it said, when it ended."""
    began = time.monotonic()
    done = await asyncio.to_thread(ferry, gateway, *args)
    return began, done, time.monotonic()


def test_add_shift_remove_and_a_broken_file_under_load_answer_every_request_once(tmp_path):
    echo = ["echo"]
    first = config({"fast@1": echo}, {"fast@1": 1})
    gateway = Gateway(tmp_path, first + f'[state]\ndir = "{tmp_path}"\n')
    try:
        async def main():
            load = Load(gateway, "fast", rate=150)
            running = asyncio.ensure_future(load.run())
            await load.answered_since(0)
            write(gateway, config({"fast@1": echo, "fast@2": echo}, {"fast@1": 1, "fast@2": 0}))
            t0, added, t1 = await step(gateway, "reload")
            await load.answered_since(t1)
            write(gateway, config({"fast@1": echo, "fast@2": echo}, {"fast@1": 1, "fast@2": 1}))
            before = admin(gateway, "GET", "/status")["last_reload"]["at"]
            gateway.process.send_signal(signal.SIGHUP)
            await until_asyncio(lambda: admin(gateway, "GET", "/status")["last_reload"]["at"] != before,
                                "ferry status to show the reload SIGHUP asked for")
            t2_done = time.monotonic()
            await load.answered_since(t2_done)
            write(gateway, config({"fast@1": echo, "fast@2": echo}, {"fast@1": 1, "fast@2": 1}).replace(
                "max_wait_ms = 2", "max_wait_ms = -1", 1))
            (tmp_path / "broken.toml").write_text(gateway.config_path.read_text())
            t3, broken, t3_done = await step(gateway, "reload")
            await load.answered_since(t3_done)
            write(gateway, config({"fast@1": echo, "fast@2": echo}, {"fast@1": 0, "fast@2": 1}))
            t4, shifted, t4_done = await step(gateway, "reload")
            await load.answered_since(t4_done)
            write(gateway, config({"fast@2": echo}, {"fast@2": 1}))
            t5, removed, t5_done = await step(gateway, "reload")
            await load.answered_since(t5_done)
            load.running = False
            await running
            stages = {
                "0/100": load.between(0, t1),
                "50/50": load.between(t2_done, t3),
                "broken": load.between(t3_done, t4),
                "100/0": load.between(t4_done, t5),
                "removed": load.between(t5_done, time.monotonic()),
            }
            reloads = [(t0, t1), (t3, t3_done), (t4, t4_done), (t5, t5_done)]
            return load, added, broken, shifted, removed, stages, reloads

        load, added, broken, shifted, removed, stages, reloads = asyncio.run(asyncio.wait_for(main(), 60))
        assert (
            added.returncode == 0
            and added.stdout == f"ferry reload: reloaded {gateway.config_path}; opened fast@2\n"
        )
        assert shifted.returncode == 0 and removed.stdout.strip().endswith("; draining fast@1")
        assert broken.returncode == 1
        at_start = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "broken.toml")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (
            at_start.returncode == 2
            and "models[0].max_wait_ms: expected milliseconds >= 0" in at_start.stderr
        )
        same_file = broken.stderr.replace(str(gateway.config_path), str(tmp_path / "broken.toml"))
        assert same_file.removeprefix("ferry reload: ") == at_start.stderr.removeprefix("ferry serve: ")
        assert stages == {"0/100": {"fast@1"}, "50/50": {"fast@1", "fast@2"}, "broken": {"fast@1", "fast@2"},
                          "100/0": {"fast@2"}, "removed": {"fast@2"}}
        statuses = [status for _, _, status, _, _ in load.results]
        assert set(statuses) == {200}
        # under load: requests were sent while each `ferry reload` ran, and answered like the rest
        assert all(any(began <= sent <= ended for sent, *_ in load.results) for began, ended in reloads)
        ids = [request_id for *_, request_id in load.results]
        assert len(set(ids)) == len(ids)
    finally:
        assert gateway.stop() == 0
    records = read_usage(str(tmp_path / "usage.sqlite"))
    assert sorted(r.request_id for r in records) == sorted(ids)  # one record per answer, none twice
    assert {r.model for r in records} == {"fast@1", "fast@2"} and {r.outcome for r in records} == {
        "completed"
    }


def test_a_removed_version_finishes_its_stream_before_its_worker_stops(tmp_path):
    slow, echo = ["sleep", "--latency-ms", "4000"], ["echo"]
    both = config({"slow@1": slow, "slow@2": echo}, {"slow@1": 1, "slow@2": 0}, alias="slow")
    gateway = Gateway(tmp_path, both + f'[state]\ndir = "{tmp_path}"\n')
    try:
        [old_worker] = [w["pid"] for w in gateway.ready()["models"]["slow@1"]["workers"]]

        async def main():
            async with aiohttp.ClientSession(headers={"x-api-key": PAID}) as session:
                body = {"model": "slow", "max_tokens": 50, "stream": True,
                        "messages": [{"role": "user", "content": "hello"}]}
                reply = await session.post(f"{gateway.url}/v1/messages", json=body)
                write(gateway, config({"slow@2": echo}, {"slow@2": 1}, alias="slow"))
                removed = await asyncio.to_thread(ferry, gateway, "reload")
                during = {v["name"]: v["state"] for v in admin(gateway, "GET", "/status")["versions"]}
                worker_alive = not gone(old_worker)
                async with session.post(
                    f"{gateway.url}/v1/messages", json={**body, "stream": False}
                ) as meanwhile:
                    meanwhile_model = (await meanwhile.json())["model"]
                stream = (await reply.read()).decode()
                return removed, during, worker_alive, meanwhile_model, stream

        removed, during, worker_alive, meanwhile_model, stream = asyncio.run(asyncio.wait_for(main(), 60))
        assert removed.stdout.strip().endswith("; draining slow@1")
        assert during == {"slow@1": "draining", "slow@2": "serving"} and worker_alive
        assert meanwhile_model == "slow@2"
        assert '"model":"slow@1"' in stream and "olleh :resU" in stream and stream.rstrip().endswith(
            'data: {"type":"message_stop"}')
        until(lambda: gone(old_worker), "the drained version's worker to stop", within=20)
        assert [v["name"] for v in admin(gateway, "GET", "/status")["versions"]] == ["slow@2"]
    finally:
        assert gateway.stop() == 0


def test_weights_roll_back_for_the_next_request_and_drain_stops_a_version(tmp_path):
    echo = ["echo"]
    both = config({"fast@1": echo, "fast@2": echo}, {"fast@1": 0, "fast@2": 1})
    gateway = Gateway(tmp_path, both + f'[state]\ndir = "{tmp_path}"\n')
    try:
        def versions(count: int = 30) -> set[str]:
            return {gateway.request("POST", "/v1/messages", {
                "model": "fast", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                "metadata": {"user_id": f"u{i}"}})[2]["model"] for i in range(count)}

        assert versions() == {"fast@2"}
        rollback = ferry(gateway, "weights", "fast", "fast@1=1", "fast@2=0")
        assert rollback.stdout == "ferry weights: fast: fast@1 100.0%, fast@2 0.0%\n"
        assert versions() == {"fast@1"}  # every request after the command returned
        status = ferry(gateway, "status").stdout
        assert "fast   fast@1   100.0%  0.0%     ferry weights" in status
        refused = ferry(gateway, "drain", "fast@1")
        assert refused.returncode == 1 and "the last version with weight in alias 'fast'" in refused.stderr
        [pid] = [w["pid"] for w in gateway.ready()["models"]["fast@2"]["workers"]]
        drained = ferry(gateway, "drain", "fast@2")
        assert drained.stdout == "ferry drain: fast@2: drained, its workers stopped\n" and gone(pid)
        assert "fast@2   stopped" in ferry(gateway, "status").stdout
        assert ferry(gateway, "reload").stdout.endswith("; opened fast@2\n")  # the file still lists it
        assert versions() == {"fast@2"}  # and the reload took the file's weights again
    finally:
        assert gateway.stop() == 0


def test_the_admin_socket_wants_its_token(tmp_path):
    gateway = Gateway(tmp_path)
    try:
        token = (tmp_path / "admin.token")
        assert (
            oct(token.stat().st_mode & 0o777) == "0o600"
            and oct((tmp_path / "admin.sock").stat().st_mode & 0o777) == "0o600"
        )
        args = argparse.Namespace(config=str(gateway.config_path), socket=None, timeout=10.0, command="test")
        token.write_text("not-the-token\n")
        assert control.call(args, "GET", "/status") == (401, {
            "error": "admin: a valid admin token is required (Authorization: Bearer ...)"})
    finally:
        assert gateway.stop() == 0


SMOLLM2 = """[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
workers = 1
kv_memory_gb = 0.1
"""


def test_a_reload_converts_a_model_first_and_a_failed_conversion_changes_nothing(tmp_path, monkeypatch):
    # The conversion cache is a file, so converting fails whether or not the model's wheel is
    # installed (a successful conversion on reload runs the same command as at start-up).
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    echo = config({"fast@1": ["echo"]}, {"fast@1": 1})
    gateway = Gateway(tmp_path, echo + f'[state]\ndir = "{tmp_path}"\n')
    try:
        write(gateway, echo + SMOLLM2)
        refused = ferry(gateway, "reload")
        assert refused.returncode == 1
        assert "models[1].model: converting 'smollm2-135m' failed (exit 1)" in refused.stderr
        assert set(gateway.ready()["models"]) == {"fast@1"}  # nothing opened, nothing lost
        status, _, answer = gateway.request("POST", "/v1/messages", {
            "model": "fast", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        assert status == 200 and answer["model"] == "fast@1"
    finally:
        assert gateway.stop() == 0
