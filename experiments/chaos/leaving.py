"""Clients that leave as their whole answer is being written: the ``whole-disconnects`` row.

Beside the row's ordinary traffic, a share of extra clients each send one whole (non-streamed)
request on its own connection and close their side at a random moment of the window in which
answers come back (a flush of up to ``max_wait_ms`` plus a call), then read whatever the
gateway still sends. Some leave before their answer is written, some while it is, some after
it arrived. Each becomes a :class:`~experiments.chaos.traffic.Shot` marked ``give_up =
"answer"``, with the status and request id of the answer if one came whole: the checks then
require that every usage record of an answer nobody received says 499 (the client left), so a
single ``failed`` row, a 500 for a client that left, is a violation.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random

from batcher.sim.arrivals import poisson
from experiments.chaos.faults import Run
from experiments.chaos.traffic import Shot

READ_FOR = 5.0  # seconds a leaver reads after closing its side, at most: what was written arrives


async def leave_as_answered(run: Run, keys: dict[str, str], model: str, rate: float,
                            window: tuple[float, float]) -> list[Shot]:
    """``rate`` leavers a second for the run's duration, each closing ``window`` (seconds after
    its request was sent, drawn uniformly) into its wait; their shots, once all have ended."""
    loop = asyncio.get_running_loop()
    draw = random.Random(run.seed + 20)
    start = loop.time()
    tasks = []
    for index, offset in enumerate(poisson(rate, run.duration, run.seed + 20).tolist()):
        tier = "paid" if draw.random() < 0.5 else "free"
        shot = Shot(100_000 + index, tier, False, f"leaving {index:06d}", start + offset, give_up="answer")
        leave_after = draw.uniform(*window)
        await asyncio.sleep(max(0.0, shot.scheduled - loop.time()))
        tasks.append(asyncio.ensure_future(_leave(run, keys[tier], model, shot, leave_after)))
    shots = list(await asyncio.gather(*tasks))
    run.clock.problems.extend(f"leaver {shot.index}: {shot.failure}" for shot in shots if shot.failure)
    return shots


async def _leave(run: Run, key: str, model: str, shot: Shot, leave_after: float) -> Shot:
    """Send the request, close the sending side ``leave_after`` seconds later, read the rest."""
    body = json.dumps({"model": model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": shot.text}]})
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: chaos\r\nx-api-key: {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    try:
        reader, writer = await asyncio.open_connection(run.server.host, run.server.port)
    except OSError as exc:
        shot.failure = f"could not connect: {type(exc).__name__}"
        return shot
    try:
        writer.write(head.encode() + body.encode())
        await asyncio.sleep(leave_after)
        writer.write_eof()
        async with asyncio.timeout(READ_FOR):
            _answered(shot, await reader.read())
    except (OSError, TimeoutError):
        pass  # closed by the gateway, or nothing came: the client left either way
    finally:
        writer.close()
    return shot


def _answered(shot: Shot, raw: bytes) -> None:
    """The status and request id of an answer that arrived whole (nothing, if none did)."""
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 "):
        return
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    if len(payload) < int(headers.get("Content-Length", "-1")):
        return  # cut short: not received
    shot.status = int(lines[0].split()[1])
    shot.request_id = headers.get("request-id")


def unreceived(shots: list[Shot], usage: list) -> str | None:
    """For a row with leavers: the outcomes recorded for the answers no client received (each
    must be ``cancelled``: a ``failed`` one is a leaver billed as a 500)."""
    if not any(shot.give_up == "answer" for shot in shots):
        return None
    received = {shot.request_id for shot in shots if shot.request_id}
    outcomes = collections.Counter(row.outcome for row in usage if row.request_id not in received)
    counts = ", ".join(f"{outcome} {outcomes[outcome]}" for outcome in ("cancelled", "completed", "failed"))
    return f"usage records of answers no client received: {counts}"
