"""Frame codec cost: microseconds to decode (and re-encode) each kind of worker frame.

    python experiments/frame_codec.py [--repeat 5] [--number 20000]

The frame bodies are built here as plain msgpack maps, the bytes a worker or a pool puts on the
pipe, so the same script measures any version of ``workers/protocol.py`` that reads them: run it
on two checkouts to compare. Each figure is the best of ``--repeat`` runs of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import timeit

import msgspec

from workers.protocol import decode_body, encode

USAGE = {"prompt_tokens": 3000, "cached_tokens": 2992, "output_tokens": 12}
FRAMES = {
    "tokens (1 id)": {"kind": "tokens", "rid": 7, "ids": [4242]},
    "finished": {"kind": "finished", "rid": 7, "reason": "eos", "usage": USAGE},
    "stats": {
        "kind": "stats", "step": 12, "running": 3, "waiting": 1, "free_blocks": 40,
        "used_blocks": 24, "total_blocks": 64, "cached_blocks": 5, "preemptions": 2, "prefix_queries": 1500,
        "prefix_hits": 320, "computed_tokens": 2100, "generated_tokens": 36,
    },
    "add (1,000 tokens)": {
        "kind": "add", "rid": 7, "prompt_tokens": list(range(1000)), "max_tokens": 64, "tier": 1,
        "tenant": "acme", "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": None,
        "stop_token_ids": [2], "ignore_eos": False,
    },
    "run_batch (50 x 200 B)": {"kind": "run_batch", "id": 1, "inputs": ["x" * 200] * 50},
    "result (50 x 200 B)": {"kind": "result", "id": 1, "outputs": ["y" * 200] * 50},
}


def best_us(call, repeat: int, number: int) -> float:
    return min(timeit.repeat(call, repeat=repeat, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()
    print("| frame | body bytes | decode µs | encode µs |")
    print("|---|---|---|---|")
    for name, fields in FRAMES.items():
        body = msgspec.msgpack.encode(fields)
        message = decode_body(body)
        assert encode(message)[4:] == body, f"{name}: the codec changed the bytes on the wire"
        decode = best_us(lambda body=body: decode_body(body), args.repeat, args.number)
        encode_cost = best_us(lambda message=message: encode(message), args.repeat, args.number)
        print(f"| {name} | {len(body)} | {decode:.2f} | {encode_cost:.2f} |")


if __name__ == "__main__":
    main()
