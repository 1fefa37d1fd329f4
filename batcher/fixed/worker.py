"""The fixed pool's side of one worker process: calls over its frames, one running at a time,
the next one framed ahead while it runs."""

from __future__ import annotations

import trio

from batcher.placement.local import PipeProcess
from workers.protocol import (
    Accepted,
    Error,
    NotDelivered,
    ProtocolError,
    Result,
    RunBatch,
    Skip,
    WorkerLost,
    encode,
)


class ProcessWorker(PipeProcess):
    """A fixed-mode worker process: a call runs at a time; the next may wait in its pipe."""

    async def call(self, request: RunBatch) -> Result | Error:
        """Send one call and wait for its answer."""
        await self.send(request)
        return (await self.reply(request.id))[1]

    async def send(self, frame: RunBatch | Skip) -> None:
        assert self._to_worker is not None, "send before start"
        try:
            await self._to_worker.send_all(encode(frame, self._max_frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise NotDelivered(f"pid {self.pid}: pipe closed ({exc})") from None

    async def reply(self, call: int) -> tuple[list[int], Result | Error]:
        try:
            accepted = await self._receive()
        except WorkerLost as exc:  # it died before reading the call (a kill racing the send)
            raise NotDelivered(f"{exc} before accepting the call") from None
        if not isinstance(accepted, Accepted) or accepted.id != call:
            raise ProtocolError(f"expected accepted {call} after run_batch {call}, got {accepted.kind}")
        reply = await self._receive()
        if not isinstance(reply, Result | Error):
            raise ProtocolError(f"expected result or error, got {reply.kind}")
        return accepted.skipped, reply
