"""Live reconfiguration in one process: the real app, bridge, fleet and rollout over scripted
backends. A new version takes traffic only once open; a dropped one finishes its streams, then
closes; a drain past its grace ends what is left with an error; a version that cannot open
changes no routing; weights take effect for the very next request; budgets reach the backends."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import trio

from gateway.accounting.usage import read_usage
from gateway.config import parse_config
from gateway.http.app import GATEWAY
from gateway.ops.rollout import ReloadFailed, Rollout
from tests.support.harness import CONFIG, ScriptedBackend, headers, in_process, playing, run, sse
from tests.support.waiting import until_asyncio

HEAD = CONFIG.split("[[models]]")[0]  # the harness's server, tier and key


def config(versions=("scripted@1", "scripted@2"), weights: dict | None = None, server: str = "") -> str:
    """Versions of the scripted model, and the alias ``scripted`` over them."""
    models = "".join(f'[[models]]\nname = "{version}"\nworker = ["echo"]\n' for version in versions)
    split = ", ".join(f'"{v}" = {w}' for v, w in (weights or {versions[0]: 1}).items())
    return (
        HEAD.replace("[server]\n", f"[server]\n{server}") + models + f"[aliases]\nscripted = {{ {split} }}\n"
    )


BOTH = config(weights={"scripted@1": 1, "scripted@2": 0})
ONLY_FIRST = config(("scripted@1",))
ONLY_SECOND = config(("scripted@2",))


def ask(text: str, **fields) -> dict:
    return {
        "model": "scripted",
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": text}],
        **fields,
    }


async def answer(client, text: str, **fields) -> dict:
    reply = await client.post("/v1/messages", json=ask(text, **fields), headers=headers())
    return await reply.json()


def rollout_of(client, text: str) -> Rollout:
    """The rollout of the app ``client`` serves, whose file now reads ``text`` (same state dir)."""
    gateway = client.server.app[GATEWAY]
    text += f'[state]\ndir = "{gateway.config.state.dir}"\n'
    return Rollout(gateway, lambda: parse_config(text, "ferry.toml"), "ferry.toml")


class Gate:
    """Opens a version only when the test lets it: a model whose workers are still loading."""

    def __init__(self, backend: ScriptedBackend) -> None:
        self.backend = backend
        self.release = threading.Event()

    @contextlib.asynccontextmanager
    async def __call__(self):
        await trio.to_thread.run_sync(self.release.wait)
        async with playing(self.backend) as backend:
            yield backend


def test_a_new_version_takes_traffic_only_once_its_backend_is_open():
    gate = Gate(ScriptedBackend())

    async def body():
        async with in_process(ScriptedBackend(), ONLY_FIRST, others={"scripted@2": gate}) as (client, _):
            rollout = rollout_of(client, config(weights={"scripted@2": 1}))
            reload = asyncio.ensure_future(rollout.reload())

            async def opening() -> dict | None:
                versions = {v["name"]: v["state"] for v in (await rollout.status())["versions"]}
                return versions if "scripted@2" in versions else None

            starting = await until_asyncio(opening, "the reload to begin opening @2", within=10, every=0.001)
            during = (await answer(client, "say:a"))["model"]
            gate.release.set()
            summary = await reload
            after = (await answer(client, "say:a"))["model"]
            return starting, during, summary, after

    starting, during, summary, after = run(body)
    assert starting == {"scripted@1": "serving", "scripted@2": "starting"}
    assert during == "scripted@1"  # the alias already names @2 in the file, but @2 is not open yet
    assert summary == "reloaded ferry.toml; opened scripted@2"
    assert after == "scripted@2"


def test_a_dropped_version_finishes_its_stream_while_new_requests_go_to_the_other_then_closes(tmp_path):
    old, new = ScriptedBackend(tick=0.01), ScriptedBackend()
    pieces = [f"p{n} " for n in range(30)]  # 30 ticks of 10 ms: the stream outlives the reload

    async def body():
        async with in_process(old, BOTH, state_dir=str(tmp_path), others={"scripted@2": new}) as (client, _):
            rollout = rollout_of(client, ONLY_SECOND)
            stream = asyncio.ensure_future(client.post("/v1/messages", headers=headers(),
                                                       json=ask("say:" + "|".join(pieces), stream=True)))
            await until_asyncio(lambda: old.playing, "the stream playing on @1", every=0.001)
            summary = await rollout.reload()
            meanwhile = (await answer(client, "say:new"))["model"]
            open_while_streaming = not old.closed
            events = sse(await (await stream).read())
            await until_asyncio(lambda: old.closed, "the dropped version to close", every=0.005)
            return summary, meanwhile, open_while_streaming, events, (await rollout.status())["versions"]

    summary, meanwhile, open_while_streaming, events, versions = run(body)
    assert summary == "reloaded ferry.toml; draining scripted@1"
    assert meanwhile == "scripted@2" and open_while_streaming
    assert events[0][1]["message"]["model"] == "scripted@1"
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "".join(pieces)
    assert events[-1][0] == "message_stop"
    assert [v["name"] for v in versions] == ["scripted@2"]
    records = read_usage(str(tmp_path / "usage.sqlite"))
    assert sorted((r.model, r.outcome) for r in records) == [
        ("scripted@1", "completed"),
        ("scripted@2", "completed"),
    ]


def test_a_drain_past_its_grace_ends_what_is_left_with_an_error_and_stops_the_version(tmp_path):
    both = config(weights={"scripted@1": 1, "scripted@2": 1}, server="shutdown_grace_ms = 100\n")
    old = ScriptedBackend()

    async def body():
        async with in_process(
            old, both, state_dir=str(tmp_path), others={"scripted@2": ScriptedBackend()}
        ) as (client, _):
            rollout = rollout_of(client, both)
            held = asyncio.ensure_future(client.post("/v1/messages", headers=headers(),
                                                     json=ask("hang", stream=True, model="scripted@1")))
            await until_asyncio(lambda: old.playing, "the held stream playing on @1", every=0.001)
            drained = await rollout.drain("scripted@1")
            events = sse(await (await held).read())
            return drained, events, (await rollout.status())["versions"]

    drained, events, versions = run(body)
    assert drained == "scripted@1: drained, its workers stopped" and old.closed
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "model scripted@1 was stopped before the request finished"}})
    assert {v["name"]: v["state"] for v in versions} == {"scripted@1": "stopped", "scripted@2": "serving"}
    [record] = read_usage(str(tmp_path / "usage.sqlite"))
    assert (record.model, record.status, record.outcome) == ("scripted@1", 200, "failed")


def test_the_last_version_with_weight_cannot_be_drained():
    async def body():
        async with in_process(ScriptedBackend(), BOTH, others={"scripted@2": ScriptedBackend()}) as (
            client,
            _,
        ):
            try:
                await rollout_of(client, BOTH).drain("scripted@1")
            except ValueError as exc:
                return str(exc), (await answer(client, "say:x"))["model"]

    message, model = run(body)
    assert (
        message
        == "scripted@1: the last version with weight in alias 'scripted'; "
        "shift its weight to another version first"
    )
    assert model == "scripted@1"


def test_a_version_that_cannot_open_changes_no_routing_but_keys_apply():
    new_key = "sk-harness-new-02"
    broken = (
        config(weights={"scripted@2": 1}) + f'[[keys]]\nkey = "{new_key}"\ntenant = "new"\ntier = "paid"\n'
    )

    @contextlib.asynccontextmanager
    async def no_gpu():
        raise OSError("no GPU")
        yield

    async def body():
        async with in_process(ScriptedBackend(), ONLY_FIRST, others={"scripted@2": no_gpu}) as (client, _):
            rollout = rollout_of(client, broken)
            try:
                await rollout.reload()
            except ReloadFailed as exc:
                failed = str(exc)
            model = (await answer(client, "say:x"))["model"]
            reply = await client.post("/v1/messages", json=ask("say:y"), headers={"x-api-key": new_key})
            return failed, model, reply.status, await rollout.status()

    failed, model, status, state = run(body)
    assert failed == (
        "ferry.toml: scripted@2 did not start: OSError: no GPU. Models and aliases are unchanged; "
        "keys, limits, tiers and safety are applied"
    )
    assert model == "scripted@1" and status == 200
    assert [v["name"] for v in state["versions"]] == ["scripted@1"]
    assert state["aliases"] == [
        {"name": "scripted", "weights": {"scripted@1": 1.0}, "file": {"scripted@1": 1.0}, "set_by": "file"}
    ]
    assert state["last_reload"]["ok"] is False


def test_weights_apply_to_the_very_next_request_and_a_later_reload_takes_the_files_again():
    sessions = [f"user-{i}" for i in range(40)]

    async def body():
        async with in_process(ScriptedBackend(), BOTH, others={"scripted@2": ScriptedBackend()}) as (
            client,
            _,
        ):
            rollout = rollout_of(client, BOTH)

            async def versions():
                return {(await answer(client, "say:x", metadata={"user_id": s}))["model"] for s in sessions}

            before = await versions()
            shifted = rollout.set_weights("scripted", {"scripted@1": 1, "scripted@2": 1})
            split = await versions()
            rollout.set_weights("scripted", {"scripted@1": 1})  # the rollback
            rolled_back = await versions()
            await rollout.reload()
            return before, shifted, split, rolled_back, (await rollout.status())["aliases"]

    before, shifted, split, rolled_back, aliases = run(body)
    assert before == {"scripted@1"} and rolled_back == {"scripted@1"}
    assert shifted == "scripted: scripted@1 50.0%, scripted@2 50.0%" and split == {"scripted@1", "scripted@2"}
    assert aliases[0]["set_by"] == "file" and aliases[0]["weights"] == {"scripted@1": 1.0, "scripted@2": 0.0}


def test_new_wait_budgets_reach_every_open_backend():
    old = ScriptedBackend()

    async def body():
        async with in_process(old, BOTH, others={"scripted@2": ScriptedBackend()}) as (client, _):
            await rollout_of(
                client, BOTH.replace('name = "paid"\n', 'name = "paid"\nwait_budget_ms = 250\n', 1)
            ).reload()

    run(body)
    assert old.queue.tiers == ("paid",) and old.queue.wait_budgets == (0.25,)
