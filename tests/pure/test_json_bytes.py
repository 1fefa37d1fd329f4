"""The HTTP path's JSON is msgspec's, and its bytes are the standard library's: any value an
answer is made of encodes as ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``
did, and a stream's text chunk, encoded around its text alone, is the chunk encoded whole."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.wire import anthropic, api, openai
from gateway.wire.api import Completion
from gateway.wire.codec import Head

TEXT = st.text(st.characters(exclude_categories=["Cs"]))  # any text but a lone surrogate
SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner) | st.dictionaries(TEXT, inner), max_leaves=30)


def stdlib(value: object) -> bytes:
    """What the HTTP path encoded before msgspec."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@given(VALUES)
def test_any_value_an_answer_is_made_of_encodes_to_the_same_bytes(value):
    assert api.dumps(value) == stdlib(value)


@given(TEXT.filter(bool))
def test_an_anthropic_text_delta_is_the_event_encoded_whole(text):
    whole = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    assert anthropic.text_delta(text) == b"event: content_block_delta\ndata: " + stdlib(whole) + b"\n\n"


@given(TEXT.filter(bool), TEXT.filter(bool), st.booleans())
def test_an_openai_chunk_is_the_chunk_encoded_whole(text, model, include_usage):
    head = Head("chatcmpl-1", model, 3, 1_700_000_000)
    chat = openai.ChatCompletions.parse(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    chat.include_usage = include_usage
    shape = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": model,
             "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
    if include_usage:
        shape["usage"] = None
    assert chat.stream(head).text(text) == b"data: " + stdlib(shape) + b"\n\n"


@given(TEXT, TEXT.filter(bool))
def test_whole_answers_are_their_documented_shape_encoded(text, model):
    head = Head("msg_1", model, 3, 1_700_000_000)
    completion = Completion(text, "end_turn", None, 5)
    one = b'"messages": [{"role": "user", "content": "x"}]'
    messages = anthropic.Messages.parse(b'{"model": "m", "max_tokens": 5, ' + one + b"}")
    expected = anthropic.message_body("msg_1", model, completion, 3)
    assert messages.whole(head, completion, False) == stdlib(expected)
    chat = openai.ChatCompletions.parse(b'{"model": "m", ' + one + b"}")
    assert json.loads(chat.whole(head, completion, False))["choices"][0]["message"]["content"] == text
