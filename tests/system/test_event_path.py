"""The event path end to end in one process: a backend that streams many deltas per request,
interleaved across requests, with failures before and after the first delta, through the real
bridge and the real aiohttp app over loopback HTTP, streamed and whole."""

from __future__ import annotations

import asyncio

from gateway.accounting.usage import read_usage
from tests.support.harness import ScriptedBackend, headers, in_process, message, run, sse
from tests.support.waiting import until_asyncio


def texts(events) -> list[str]:
    return [data["delta"]["text"] for name, data in events if name == "content_block_delta"]


def test_interleaved_streams_each_get_their_own_deltas_in_order():
    backend = ScriptedBackend()

    async def body():
        async with in_process(backend) as (client, bridge):
            async def one(index):
                pieces = [f"{index}-{n} " for n in range(8)]
                response = await client.post(
                    "/v1/messages", json=message("say:" + "|".join(pieces), stream=True), headers=headers()
                )
                return pieces, sse(await response.read())

            results = await asyncio.gather(*(one(i) for i in range(20)))
            return results, bridge.hops_to_asyncio

    results, hops = run(body)
    for pieces, events in results:
        assert "".join(texts(events)) == "".join(pieces)
        assert len(texts(events)) > 1  # streamed as made, not gathered into one delta
        names = [name for name, _ in events if name != "ping"]
        assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
            "content_block_stop", "message_delta", "message_stop"]
        delta = next(data for name, data in events if name == "message_delta")
        assert delta["delta"]["stop_reason"] == "end_turn"
        assert delta["usage"]["output_tokens"] == len("".join(pieces).encode())
    assert hops < 20 * 10  # each tick's events for every stream crossed together


def test_a_whole_answer_joins_the_deltas_and_bills_what_it_delivered(tmp_path):
    async def body():
        async with in_process(ScriptedBackend(), state_dir=str(tmp_path)) as (client, _):
            response = await client.post("/v1/messages", json=message("say:Hel|lo |wörld"), headers=headers())
            return response.status, response.headers["request-id"], await response.json()

    status, request_id, reply = run(body)
    assert status == 200 and reply["content"][0]["text"] == "Hello wörld"
    assert reply["usage"]["output_tokens"] == len("Hello wörld".encode())
    [record] = read_usage(str(tmp_path / "usage.sqlite"))
    assert (record.request_id, record.status, record.outcome, record.output_tokens) == (
        request_id, 200, "completed", len("Hello wörld".encode()))


def test_a_stop_sequence_split_across_deltas_is_honoured_and_never_shown():
    backend = ScriptedBackend()

    async def body():
        async with in_process(backend) as (client, _):
            script = message("say:Hel|lo Hu|man: secret|more", stream=True, stop_sequences=["Human:"])
            streamed = sse(await (await client.post("/v1/messages", json=script, headers=headers())).read())
            whole = await (await client.post("/v1/messages", json={**script, "stream": False},
                                             headers=headers())).json()
            return streamed, whole

    streamed, whole = run(body)
    assert "".join(texts(streamed)) == "Hello " == whole["content"][0]["text"]
    assert not any("Hu" in text for text in texts(streamed))
    delta = next(data for name, data in streamed if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Human:"}
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "Human:")
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == len(b"Hello ")


def test_a_failure_before_the_first_delta_gets_its_real_status_streamed_or_whole(tmp_path):
    async def body():
        async with in_process(ScriptedBackend(), state_dir=str(tmp_path)) as (client, _):
            streamed = await client.post(
                "/v1/messages", json=message("fail-before", stream=True), headers=headers()
            )
            whole = await client.post("/v1/messages", json=message("fail-before"), headers=headers())
            return (streamed.status, await streamed.json()), (whole.status, await whole.json())

    for status, reply in run(body):
        assert status == 500 and reply["error"] == {
            "type": "api_error",
            "message": "the input failed on its own",
        }
    records = read_usage(str(tmp_path / "usage.sqlite"))
    assert [(r.status, r.outcome, r.output_tokens) for r in records] == [(500, "failed", 0)] * 2


def test_a_stream_that_fails_after_sending_text_ends_with_an_error_event_and_bills_what_it_sent(tmp_path):
    async def body():
        async with in_process(ScriptedBackend(), state_dir=str(tmp_path)) as (client, _):
            streamed = await client.post("/v1/messages", json=message("fail-after:one |two ", stream=True),
                                         headers=headers())
            whole = await client.post("/v1/messages", json=message("fail-after:one |two "), headers=headers())
            return streamed.status, sse(await streamed.read()), whole.status

    status, events, whole_status = run(body)
    assert status == 200 and texts(events) == ["one ", "two "]
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "the worker was lost"}},
    )
    assert whole_status == 500  # a whole answer is all or nothing
    stream_record, whole_record = read_usage(str(tmp_path / "usage.sqlite"))
    assert (stream_record.status, stream_record.outcome, stream_record.output_tokens) == (
        200,
        "interrupted",
        8,
    )
    assert (whole_record.status, whole_record.outcome, whole_record.output_tokens) == (500, "failed", 0)


def test_a_client_that_leaves_mid_stream_cancels_its_job_and_is_recorded_as_gone(tmp_path):
    backend = ScriptedBackend()

    async def body():
        async with in_process(backend, state_dir=str(tmp_path)) as (client, _):
            response = await client.post("/v1/messages", json=message("hang", stream=True), headers=headers())
            await response.content.readuntil(b"\n\n")  # message_start: the stream is open
            response.close()
            await until_asyncio(lambda: backend.cancelled, "the core to be told the client left", every=0.005)
        return backend.cancelled

    [prompt] = run(body)
    assert prompt.endswith("User: hang")
    [record] = read_usage(str(tmp_path / "usage.sqlite"))
    assert (record.status, record.outcome) == (499, "cancelled")
