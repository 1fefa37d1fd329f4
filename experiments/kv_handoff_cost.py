"""What one prefill -> decode hand-off costs the two engines, apart from the pipe: the prefill
engine's export (read the blocks, BLAKE2b, encode the ``kv`` frames) and the decode engine's
import (decode the frames, check the digest, write the blocks), for prompts of several lengths,
SmolLM2-135M's cache in float32 (45 KiB a token), one thread; side by side, the same over shared
memory (``--kv-shm``: the blocks written to a /dev/shm file and read back, no frames), whose
figures include all it moves (no pipe follows).

The bytes do not depend on what the KV holds, so the cache is not filled by a prefill: the
hand-off of a sequence of N tokens is timed as :mod:`workers.engine.kv_transfer` does it, the
median of ``--rounds``. The pipe between the processes (through the pool) is not in these figures;
``ferry_engine_kv_handoff_seconds`` measures the whole pause a served hand-off adds.

    python -m experiments.kv_handoff_cost --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from workers.convert import ensure_converted
from workers.engine.block_manager import cdiv
from workers.engine.kv_transfer import CHUNK_BYTES, digest
from workers.engine.runner import ModelRunner
from workers.kv_manifest import read_segment, write_segment
from workers.protocol import FrameDecoder, KvBlocks, encode

LENGTHS = (100, 1000, 3000)


def handoff(runner: ModelRunner, tokens: int, shm: bool) -> tuple[float, float, int]:
    """Seconds to export and to import the KV of ``tokens`` tokens (over frames, or a shared-memory
    segment), and its bytes."""
    blocks = list(range(cdiv(tokens, runner.block_size)))
    started = time.perf_counter()
    data = runner.read_blocks(blocks)
    check = digest(data)
    step = max(1, CHUNK_BYTES // runner.block_bytes) * runner.block_bytes
    if shm:
        segment = write_segment(f"ferry-kv-{os.getpid()}-0", data)
        assert segment, "no room in /dev/shm"
    else:
        wire = b"".join(encode(KvBlocks(0, data[i : i + step])) for i in range(0, len(data), step))
    exported = time.perf_counter()
    received = bytearray()
    if shm:
        received = read_segment(segment, len(data))
    else:
        for frame in FrameDecoder().feed(wire):
            received += frame.data  # type: ignore[union-attr]  # every frame here is a KvBlocks
    assert digest(received) == check
    runner.write_blocks(blocks[::-1], received)  # other blocks than it read, as a decode engine's are
    return exported - started, time.perf_counter() - exported, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed hand-offs per length (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(ensure_converted("smollm2-135m"), num_blocks=cdiv(max(LENGTHS), 16))
    print("| path | prompt tokens | KV bytes | export ms | import ms | MB/s end to end |")
    print("|---|---:|---:|---:|---:|---:|")
    for tokens in LENGTHS:
        for shm in (False, True):  # side by side, alternating
            handoff(runner, tokens, shm)  # warm
            runs = [handoff(runner, tokens, shm) for _ in range(args.rounds)]
            out = statistics.median(run[0] for run in runs)
            into = statistics.median(run[1] for run in runs)
            size = runs[0][2]
            rate = size / (out + into) / 1e6
            path = "shm" if shm else "frames"
            print(f"| {path} | {tokens} | {size:,} | {out * 1000:.1f} | {into * 1000:.1f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
