"""HTTP codec cost: microseconds to parse a request body, encode one SSE chunk, and encode a
whole answer, on each API's route.

    .venv/bin/python -m experiments.http_codec [--repeat 5] [--number 20000]

It calls only the codecs' interface (``Codec.parse``, ``codec.whole``, ``codec.stream(head).text``),
so the same script measures any version of ``gateway/wire``: run it on two checkouts to compare.
Each figure is the best of ``--repeat`` runs of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import json

from experiments.frame_codec import best_us
from gateway.wire import openai
from gateway.wire.anthropic import Messages
from gateway.wire.api import Completion
from gateway.wire.codec import Head

HEAD = Head("msg_1a2b3c4d_17", "smollm2-135m-instruct@1", 42, 1_760_000_000)
PIECE = " Paris,"  # one token's text, what a continuous model's stream sends per chunk
ANSWER = Completion("The capital of France is Paris. " * 4, "end_turn", None, 33)
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy? Answer in one sentence, please."},
]
BODIES = {
    Messages: {"model": "smollm2", "max_tokens": 64, "messages": CONVERSATION, "stream": True,
               "system": "Be brief.", "temperature": 0.7, "metadata": {"user_id": "u-17"}},
    openai.ChatCompletions: {"model": "smollm2", "max_tokens": 64, "stream": True, "temperature": 0.7,
                             "messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()
    print("| route | parse a request µs | one SSE chunk µs | a whole answer µs |")
    print("|---|---|---|---|")
    for route, fields in BODIES.items():
        body = json.dumps(fields).encode()
        codec = route.parse(body)
        stream = codec.stream(HEAD)
        stream.text(PIECE)  # the first piece opens the text block (Anthropic): measure the rest
        parse = best_us(lambda: route.parse(body), args.repeat, args.number)  # noqa: B023
        chunk = best_us(lambda: stream.text(PIECE), args.repeat, args.number)  # noqa: B023
        whole = best_us(lambda: codec.whole(HEAD, ANSWER, False), args.repeat, args.number)  # noqa: B023
        print(f"| {route.__name__} | {parse:.2f} | {chunk:.2f} | {whole:.2f} |")


if __name__ == "__main__":
    main()
