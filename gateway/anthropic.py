"""The Anthropic Messages route as a :class:`~gateway.codec.Codec`: the rules and bytes of
:mod:`gateway.api`, with the state a stream needs (whether its text block is open yet)."""

from __future__ import annotations

from batcher.backend import Sampling
from gateway import api
from gateway.codec import Call, Head


class Messages:
    """``POST /v1/messages``."""

    id_prefix = "msg_"
    idempotency_scope = ""  # the first route: its keys keep the scope they always had
    error_response = staticmethod(api.error_response)
    error_reply = staticmethod(api.error_reply)

    def __init__(self, request: api.MessageRequest) -> None:
        self.request = request
        sampling = Sampling(request.temperature, request.top_p, request.top_k)
        self.call = Call(request.model, request.max_tokens, request.system, request.messages,
                         sampling=sampling, stream=request.stream, stop_sequences=request.stop_sequences,
                         session=request.user_id)

    @classmethod
    def parse(cls, body: bytes) -> Messages:
        return cls(api.parse_message_request(body))

    def whole(self, head: Head, completion: api.Completion, blocked: bool) -> bytes:
        return api.dumps(api.message_body(head.request_id, head.model, completion, head.input_tokens))

    def stream(self, head: Head) -> MessageStream:
        return MessageStream(head)


class MessageStream:
    """``message_start``, the text block opened with its first text (or at the end, empty),
    deltas, then the stop events, or an ``error`` event."""

    ping = api.PING

    def __init__(self, head: Head) -> None:
        self._head = head
        self._block = False  # content_block_start sent

    def start(self) -> bytes:
        return api.stream_start(self._head.request_id, self._head.model, self._head.input_tokens)

    def text(self, text: str) -> bytes:
        return self._open() + api.text_delta(text) if text else b""

    def stop(self, stop_reason: str, stop_sequence: str | None, output_tokens: int, blocked: bool) -> bytes:
        return self._open() + api.stream_stop(stop_reason or "end_turn", stop_sequence, output_tokens)

    def error(self, error: BaseException) -> bytes:
        return api.stream_error(error)

    def _open(self) -> bytes:
        if self._block:
            return b""
        self._block = True
        return api.BLOCK_START
