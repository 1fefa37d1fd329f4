"""A client of the Messages route's server-sent events over aiohttp, as the continuous-mode tests
read them: each stream's events, its text, and when each piece of text came."""

from __future__ import annotations

import itertools
import time

from tests.support.gateway_process import PAID
from tests.support.harness import sse


async def stream(session, url: str, request: dict, leave_after: int | None = None,
                 progress: dict | None = None) -> dict:
    """One streamed request: its events, its text, when its deltas came (since it was sent, and
    on the monotonic clock); with ``leave_after``, the connection is closed once that many
    deltas have arrived. The result is ``progress`` where given, filled in as the events come,
    so that the caller can watch the stream while it runs."""
    started = time.monotonic()
    result = progress if progress is not None else {}
    result.update(events=[], text="", times=[], at=[], status=None)
    async with session.post(url + "/v1/messages", json={**request, "stream": True},
                            headers={"x-api-key": PAID}) as response:
        result["status"] = response.status
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            *blocks, buffer = buffer.split(b"\n\n")
            for name, data in sse(b"\n\n".join(blocks) + b"\n\n") if blocks else []:
                result["events"].append((name, data))
                if name == "content_block_delta":
                    result["text"] += data["delta"]["text"]
                    result["at"].append(time.monotonic())
                    result["times"].append(result["at"][-1] - started)
                    if leave_after is not None and len(result["times"]) >= leave_after:
                        response.close()
                        return result
    return result


def message_id(result: dict) -> str:
    """The id a stream's ``message_start`` gave it: its usage record's request id."""
    return result["events"][0][1]["message"]["id"]


def interleaved(results: list[dict]) -> int:
    """How often the next delta to arrive, of all the streams, was another stream's: one stream
    after another would make it len(results) - 1."""
    order = sorted((at, index) for index, result in enumerate(results) for at in result["at"])
    return sum(1 for (_, a), (_, b) in itertools.pairwise(order) if a != b)
