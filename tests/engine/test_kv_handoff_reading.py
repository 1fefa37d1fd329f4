"""A busy decode engine reads a hand-off's ``kv`` frames to their end before its next step, over a
real pipe (``workers/engine/serve.py``'s loop, SmolLM2-135M in float32). A pipe holds 64 KiB,
and the pool, another process on busy cores, refills it a little after the engine drains it; an
engine that stepped whenever a poll found the pipe empty took one pipe's worth a step, so a
few MB of KV waited dozens of steps (experiments/docs/continuous-pd.md). The writer here refills
2 ms after each 64 KiB, as such a pool does.
"""

from __future__ import annotations

import os
import threading
import time

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.kv_transfer import KvTransfer
from workers.engine.serve import run
from workers.protocol import Abort, Add, FrameDecoder, KvExported, KvHandoff, Message, Tokens, encode
from workers.sampling import Sampling

GREEDY = Sampling(max_tokens=4, ignore_eos=True)
BUSY = Sampling(max_tokens=600, temperature=0.0, ignore_eos=True)  # decodes all along
HANDED, RUNNING = 1, 2
PIPE_BYTES = 1 << 16



def new_engine(runner) -> Engine:
    return Engine(runner, EngineConfig(block_size=runner.block_size, num_blocks=runner.num_blocks,
                                       max_batch_tokens=64, max_seqs=4, watermark=0.0))


def handoff_bytes(runner) -> bytes:
    """A 200-token prompt's hand-off as the pool writes it: its ``kv`` frames (~9 MB), then
    its ``kv_handoff``."""
    prefill = new_engine(runner)
    out = KvTransfer(prefill, runner, prefill=True)
    prompt = list(range(1, 201))
    prefill.add(prompt, GREEDY, rid=HANDED)
    frames: list[Message] = []
    while not frames:
        output = prefill.step()
        frames = out.exports(output)
    *chunks, exported = frames
    assert isinstance(exported, KvExported)
    greedy = GREEDY.replace(temperature=0.0)
    add = Add.of(HANDED, prompt, 0, "", greedy, output_tokens=[output.tokens[HANDED]])
    return b"".join(map(encode, [*chunks, KvHandoff(add, exported.manifest)]))


def pool_write(fd: int, data: bytes) -> None:
    """``data`` into the pipe a pipe's worth at a time, each 2 ms after the one before."""
    for start in range(0, len(data), PIPE_BYTES):
        os.write(fd, data[start : start + PIPE_BYTES])  # blocks while the pipe is full
        time.sleep(0.002)


def test_a_busy_decode_engine_reads_a_hand_off_whole_before_its_next_step(smollm2_runner, decode_runner):
    handoff = handoff_bytes(smollm2_runner)
    to_engine, engine_in = os.pipe()[::-1]
    engine_out, from_engine = os.pipe()[::-1]
    decode = new_engine(decode_runner)
    out = os.fdopen(engine_out, "wb")
    engine = threading.Thread(target=run, args=(decode, engine_in, out),
                              kwargs={"handoffs": KvTransfer(decode, decode_runner, prefill=False)})
    engine.start()
    decoder = FrameDecoder()

    def tokens() -> list[Tokens]:
        return [m for m in decoder.feed(os.read(from_engine, 1 << 16)) if isinstance(m, Tokens)]

    try:
        os.write(to_engine, encode(Add.of(RUNNING, [5, 6, 7], 0, "", BUSY)))
        while not tokens():  # the engine is stepping
            pass
        writer = threading.Thread(target=pool_write, args=(to_engine, handoff))
        writer.start()
        steps_before = 0  # the running sequence's steps until the handed one's first token
        seen = tokens()
        while HANDED not in {frame.rid for frame in seen}:
            steps_before += len(seen)
            seen = tokens()
        writer.join()
        # at most the step it was in when the hand-off began, and the one that made that token
        assert steps_before <= 2
    finally:
        os.write(to_engine, b"".join(encode(Abort(rid)) for rid in (HANDED, RUNNING)))
        os.close(to_engine)
        engine.join()
        out.close()
        for fd in (engine_in, from_engine):
            os.close(fd)
