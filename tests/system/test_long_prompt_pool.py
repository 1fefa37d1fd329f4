"""The long-prompt pool over real HTTP: ``ferry serve`` with one ordinary and one long SmolLM2-135M
engine (float32, one thread each, the long one with its own KV cache and step budget). A long
prompt is computed by the long replica and the short ones by the ordinary one, as ``/metrics``
(each replica's prompt tokens looked up in its prefix cache) and ``/readyz`` show it.
"""

from __future__ import annotations

from tests.support.gateway_process import Gateway, tiers_and_keys

LONG = 300  # long_prompt_tokens

CONFIG = f"""
[server]
port = 0

{tiers_and_keys(60000)}

[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
workers = 1
threads = 1
num_blocks = 64
max_batch_tokens = 128
max_seqs = 8
temperature = 0.0
long_prompt_tokens = {LONG}
long_workers = 1
long_num_blocks = 128
long_max_batch_tokens = 256
"""


def ask(gateway: Gateway, content: str) -> dict:
    body = {"model": "smollm2@1", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    status, _, answer = gateway.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    return answer


def test_a_long_prompt_is_computed_by_the_long_replica_and_short_ones_by_the_ordinary_one(
    tmp_path, smollm2,
):
    gateway = Gateway(tmp_path, CONFIG)
    try:
        queried = "ferry_engine_prefix_cache_queries_total"
        workers = gateway.ready()["models"]["smollm2@1"]["workers"]
        assert [w.get("long_pool", 0) for w in workers] == [0, 1]
        for topic in ("the sea", "bread", "rain"):
            ask(gateway, f"Write one line about {topic}.")
        short = gateway.metric(queried, model="smollm2@1", replica="0")
        assert 0 < short < LONG and gateway.metric(queried, model="smollm2@1", replica="1") == 0
        answer = ask(gateway, "Summarise this log. " + "The ferry left the harbour at noon. " * 60)
        prompt = answer["usage"]["prompt_tokens"]
        assert prompt > LONG
        assert gateway.metric(queried, model="smollm2@1", replica="1") == prompt
        assert gateway.metric(queried, model="smollm2@1", replica="0") == short
    finally:
        assert gateway.stop() == 0
