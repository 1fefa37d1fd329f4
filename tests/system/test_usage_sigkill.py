"""A SIGKILLed gateway bills every request it answered: the usage record is written ahead of
the answer's last bytes, and the next start puts it into the table."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import Gateway, message
from tests.support.processes import gone
from tests.support.waiting import until, until_asyncio

KILLED_AMONG = 50  # answers whole before the SIGKILL, with 16 clients still asking


def test_every_answer_a_client_got_has_its_usage_row_after_the_gateway_is_sigkilled(tmp_path):
    gateway = Gateway(tmp_path)
    workers = gateway.worker_pids()
    answered = asyncio.run(asyncio.wait_for(answers_until_killed(gateway), 60))
    gateway.process.wait(10)
    gateway.process.stdout.close()  # type: ignore[union-attr]
    until(lambda: all(gone(pid) for pid in workers),  # orphaned workers see their pipe close and exit
          "every worker of the killed gateway to exit", within=10)

    restarted = Gateway(tmp_path)  # the same state directory: its start writes what was journaled
    assert restarted.stop() == 0
    records = {record.request_id: record for record in read_usage(str(tmp_path / "usage.sqlite"))}
    missing = sorted(set(answered) - set(records))
    assert missing == [], f"{len(missing)} of {len(answered)} answered requests have no usage row"
    assert {(records[rid].status, records[rid].outcome) for rid in answered} == {(200, "completed")}
    assert all(records[rid].output_tokens == tokens for rid, tokens in answered.items())
    assert not list(tmp_path.glob("usage.sqlite.ahead.*"))  # a clean stop leaves no journal behind


async def answers_until_killed(gateway: Gateway) -> dict[str, int]:
    """16 clients asking in a loop, one request in four streamed, until the gateway is
    SIGKILLed among them, once 50 answers have arrived: the request id and output tokens of
    every answer that arrived whole."""
    answered: dict[str, int] = {}
    killed = asyncio.Event()

    async def client(index: int) -> None:
        async with aiohttp.ClientSession(headers={"x-api-key": "sk-test-paid-0001"}) as session:
            for turn in range(10_000):
                stream = (index + turn) % 4 == 0
                try:
                    async with session.post(f"{gateway.url}/v1/messages",
                                            json=message(f"c{index} t{turn}", stream=stream)) as reply:
                        body = await reply.read()
                        if reply.status != 200:
                            continue
                        if stream and b"message_stop" not in body:
                            continue  # cut short: not an answer
                        answered[reply.headers["request-id"]] = tokens(body, stream)
                except aiohttp.ClientError:
                    if killed.is_set():
                        return
                    raise

    async def kill() -> None:
        try:
            await until_asyncio(lambda: len(answered) >= KILLED_AMONG, f"{KILLED_AMONG} answers, whole",
                                within=40)
        finally:
            os.kill(gateway.process.pid, signal.SIGKILL)
            killed.set()

    await asyncio.gather(kill(), *(client(i) for i in range(16)))
    return answered


def tokens(body: bytes, stream: bool) -> int:
    """The output tokens an answer reports (the last usage of a stream)."""
    marker = b'"output_tokens":'
    at = body.rfind(marker) + len(marker)
    return int(body[at:].split(b"}", 1)[0].split(b",", 1)[0])
