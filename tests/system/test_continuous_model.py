"""Continuous mode with real models over real HTTP: ``ferry serve`` with two engine workers of the
tiny random checkpoint (its own tokenizer and ChatML template), driven by the official
``anthropic`` SDK unchanged; and SmolLM2-135M-Instruct once, answering a real question (whole,
streamed with its prefix from the cache, continuing a prefill) through both SDKs.

The models are configured greedy (``temperature = 0.0``: the SDK sends none). The tiny
checkpoint is untied (a tied one at this size greedily repeats its last token), greedy
choices are clear-cut, and the engine's batches do not change a sequence's logits, so a prompt
answers the same alone or among twenty others.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import anthropic
import openai
import pytest

from batcher.continuous.config import converted_dir
from tests.support.gateway_process import PAID, Gateway
from tests.support.sse_client import interleaved, stream

KEYS = f"""
[server]
port = 0
ping_interval_ms = 200

[[tiers]]
name = "paid"
wait_budget_ms = 60000

[[keys]]
key = "{PAID}"
tenant = "tests"
tier = "paid"
"""


def serving(tmp, name: str, model: str, **fields) -> Gateway:
    table = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in fields.items())
    config = KEYS + f'\n[[models]]\nname = "{name}"\nmode = "continuous"\nmodel = "{model}"\n{table}'
    return Gateway(tmp, config + f'\n[state]\ndir = "{tmp}"\n')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_checkpoints):
    server = serving(tmp_path_factory.mktemp("tiny"), "tiny@1", str(tiny_checkpoints["untied-llama3"]),
                     workers=2, num_blocks=512, max_batch_tokens=128, max_seqs=32, context_window=256,
                     temperature=0.0)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(tiny):
    return anthropic.Anthropic(base_url=tiny.url, api_key=PAID, max_retries=0)


def ask(client, text: str, max_tokens: int = 24, **fields):
    return client.messages.create(model="tiny@1", max_tokens=max_tokens,
                                  messages=[{"role": "user", "content": text}], **fields)


def test_the_sdk_creates_and_streams_the_same_answer(client):
    reply = ask(client, "The pilot counts the cars")
    assert (reply.model, reply.role, reply.stop_reason) == ("tiny@1", "assistant", "max_tokens")
    assert reply.usage.output_tokens == 24 and reply.content[0].text
    with client.messages.stream(
        model="tiny@1", max_tokens=24, messages=[{"role": "user", "content": "The pilot counts the cars"}]
    ) as streaming:
        text = "".join(streaming.text_stream)
        final = streaming.get_final_message()
    assert text == reply.content[0].text == final.content[0].text
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 24)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its prefix came from the cache


def test_a_stop_sequence_split_across_two_tokens_is_honoured_and_never_shown(tiny, client):
    request = {"model": "tiny@1", "max_tokens": 24,
               "messages": [{"role": "user", "content": "Tickets cost 3 coins"}]}
    pieces = [data["delta"]["text"] for name, data in asyncio.run(_stream(tiny, request))["events"]
              if name == "content_block_delta"]
    text = "".join(pieces)
    boundary, at = 0, None
    for left, right in itertools.pairwise(pieces):  # one token each: the server was idle
        boundary += len(left)
        stop = left[-1:] + right[:1]
        if len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == boundary - 1:
            at = boundary - 1
            break
    assert at is not None, pieces
    reply = ask(client, "Tickets cost 3 coins", stop_sequences=[stop])
    assert (reply.content[0].text, reply.stop_reason, reply.stop_sequence) == (
        text[:at],
        "stop_sequence",
        stop,
    )
    streamed = asyncio.run(_stream(tiny, {**request, "stop_sequences": [stop]}))
    assert streamed["text"] == text[:at]


async def _stream(gateway, request):
    async with aiohttp.ClientSession() as session:
        return await stream(session, gateway.url, request)


def test_twenty_concurrent_streams_interleave_and_each_is_what_its_prompt_gives_alone(tiny, client):
    prompts = [f"The ferry crossing number {i} leaves at dawn" for i in range(20)]
    alone = [ask(client, prompt, 48).content[0].text for prompt in prompts]

    async def together():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(
                stream(session, tiny.url, {"model": "tiny@1", "max_tokens": 48,
                                           "messages": [{"role": "user", "content": p}]})
                for p in prompts))

    results = asyncio.run(together())
    assert [r["text"] for r in results] == alone
    # Streamed as made: whole answers would be one delta each and one stream after another.
    # Tokens that reach the gateway in one hand-off leave in one delta, so how many deltas a
    # single stream gets depends on how busy the machine is; the fleet's total does not.
    assert sum(len(r["times"]) for r in results) > 3 * len(results)
    assert interleaved(results) > 2 * len(results)


def test_smollm2_answers_a_real_question_whole_and_streamed(tmp_path):
    gateway = serving(tmp_path, "smollm2@1", "smollm2-135m", max_batch_tokens=256, kv_memory_gb=0.25,
                      temperature=0.0)
    try:
        smol = anthropic.Anthropic(base_url=gateway.url, api_key=PAID, max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = smol.messages.create(model="smollm2@1", max_tokens=20, messages=question)
        assert "Paris" in reply.content[0].text and reply.stop_reason == "end_turn"
        with smol.messages.stream(model="smollm2@1", max_tokens=20, messages=question) as streaming:
            assert "".join(streaming.text_stream) == reply.content[0].text
            repeated = streaming.get_final_message().usage  # the same prompt: its prefix is cached
        prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
        assert repeated.cache_read_input_tokens >= 16
        assert repeated.input_tokens + repeated.cache_read_input_tokens == prompt
        # A prefill: the answer continues the assistant's words, and does not repeat them
        prefilled = smol.messages.create(model="smollm2@1", max_tokens=20, messages=[
            *question, {"role": "assistant", "content": "The capital of France is"}])
        assert prefilled.content[0].text.lstrip().startswith("Paris")
        gpt = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=PAID, max_retries=0)
        chat = [gpt.chat.completions.create(model="smollm2@1", max_tokens=20, messages=question)
                for _ in range(2)]
        assert chat[1].usage.prompt_tokens_details.cached_tokens >= 16
        assert chat[0].choices[0].message.content == reply.content[0].text
        assert smol.models.retrieve("smollm2@1").max_input_tokens == 8191
        converted = converted_dir(
            "smollm2-135m"
        )  # the one-time conversion says what it did, or that it is done
        assert any(line.startswith(f"{converted}: ") for line in gateway.lines), gateway.lines
    finally:
        assert gateway.stop() == 0
