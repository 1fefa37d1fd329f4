"""The mode registry: a mode registered there alone is a mode like the others. Its model tables
load from a config file (its own fields checked), the production launch prepares it inside the
trio core at start-up and at a reload, the gateway serves its requests over real HTTP, and
/readyz and /metrics show its status and its own families without knowing it."""

from __future__ import annotations

import functools

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from batcher.core.modes import MODES
from gateway.bridge import Bridge, open_backend
from gateway.config import parse_config
from gateway.http.app import GATEWAY, make_app
from gateway.ops.rollout import Rollout
from tests.support.harness import CONFIG, headers, run
from tests.support.toy_mode import mode as toy_mode

HEAD = CONFIG.split("[[models]]")[0]  # the harness's server, tier and key
TOY = '[[models]]\nname = "toy@1"\nmode = "toy"\nsuffix = "!?"\n'
SECOND_TOY = '[[models]]\nname = "toy@2"\nmode = "toy"\n'


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(MODES, "toy", "tests.support.toy_mode")
    toy_mode.PREPARED.clear()


async def answer(client, model: str, text: str) -> dict:
    body = {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": text}]}
    return await (await client.post("/v1/messages", json=body, headers=headers())).json()


def test_a_mode_that_is_not_registered_is_refused_naming_the_modes_there_are():
    refused = r"models\[0\]\.mode: expected one of \['continuous', 'fixed'\], got 'toy'"
    with pytest.raises(ValueError, match=refused):
        parse_config(HEAD + TOY)


def test_a_registered_mode_checks_its_own_fields_where_the_file_names_them(toy):
    with pytest.raises(ValueError, match=r"models\[0\]\.suffix: expected at most 3 characters, got '!!!!'"):
        parse_config(HEAD + TOY.replace('"!?"', '"!!!!"'))


def test_a_mode_registered_alone_serves_over_http_prepared_in_the_core_at_start_and_at_reload(toy, tmp_path):
    state = f'[state]\ndir = "{tmp_path}"\n'
    config = parse_config(HEAD + TOY + state)

    async def body():
        bridge = Bridge(open_backend, config.models, config.queue())
        await bridge.start()
        client = TestClient(TestServer(make_app(config, bridge)))
        await client.start_server()
        try:
            reply = await answer(client, "toy@1", "hello")
            ready = await client.get("/readyz")
            metrics = await (await client.get("/metrics")).text()
            reread = functools.partial(parse_config, HEAD + TOY + SECOND_TOY + state)
            rollout = Rollout(client.server.app[GATEWAY], reread, "ferry.toml")
            await rollout.reload()
            second = await answer(client, "toy@2", "again")
            return reply, ready.status, await ready.json(), metrics, second
        finally:
            await client.close()
            await bridge.stop()

    reply, ready, readiness, metrics, second = run(body)
    assert (reply["model"], reply["content"][0]["text"]) == ("toy@1", "HELLO!?")
    assert reply["stop_reason"] == "end_turn"
    assert second["content"][0]["text"] == "AGAIN!"
    assert ready == 200
    assert readiness["models"]["toy@1"] == {"ready": True, "reason": "", "workers": [], "queued": 0,
                                            "queued_unit": "shouts", "answers": 1}
    samples = {s.name: s for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.labels.get("model") == "toy@1"}
    assert samples["ferry_toy_answers_total"].value == 1
    assert samples["ferry_queued_shouts"].value == 0
    assert not any(name.startswith(("ferry_flushes", "ferry_batch", "ferry_engine")) for name in samples)
    # start-up prepared toy@1, the reload toy@2 (asking the core, then as it opened): all on the trio thread
    assert [name for name, _ in toy_mode.PREPARED] == ["toy@1", "toy@2", "toy@2"]
    assert all(in_trio for _, in_trio in toy_mode.PREPARED)
