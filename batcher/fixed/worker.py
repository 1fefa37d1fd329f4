"""The fixed pool's side of one worker process: a ``run_batch`` call at a time over its frames."""

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
    WorkerLost,
    encode,
)


class ProcessWorker(PipeProcess):
    """A fixed-mode worker process: one ``run_batch`` call at a time."""

    async def call(self, request: RunBatch) -> Result | Error:
        assert self._to_worker is not None, "call before start"
        try:
            await self._to_worker.send_all(encode(request, self._max_frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise NotDelivered(f"pid {self.pid}: pipe closed ({exc})") from None
        try:
            accepted = await self._receive()
        except WorkerLost as exc:  # it died before reading the call (a kill racing the send)
            raise NotDelivered(f"{exc} before accepting the call") from None
        if accepted != Accepted(request.id):
            raise ProtocolError(
                f"expected accepted {request.id} after run_batch {request.id}, got {accepted.kind}"
            )
        reply = await self._receive()
        if not isinstance(reply, Result | Error):
            raise ProtocolError(f"expected result or error, got {reply.kind}")
        return reply
