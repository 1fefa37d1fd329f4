"""``python -m workers engine``: the continuous engine behind the framed pipe (workers/protocol.py).

The loop. While the engine has work, each turn takes whatever frames have already arrived
(``poll`` with timeout 0, at most 1 MiB, so a flood of ``add`` frames cannot stall running
decodes), runs one step, and writes that step's ``tokens`` and ``finished`` frames, plus
``stats`` when 200 ms have passed, in one write. While idle it blocks on the pipe, waking only
to send ``stats``. EOF on the pipe ends it (exit 0); the parent watchdog of
``workers/__main__.py`` ends it when the gateway dies.

A frame that breaks the protocol exits 2: one that does not decode, a kind the engine does not
take, an ``add`` the engine refuses (a rid already live, sampling out of range, an empty
prompt; the gateway validates requests, so these are the pool's bugs). The pool treats that like
a crash and restarts the worker. An ``abort`` of a rid the engine does not hold (it has just
finished) is ignored.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections.abc import Callable
from typing import BinaryIO

from workers.engine.batch import Runner
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS
from workers.engine.engine import Engine, SequenceEnd, StepOutput
from workers.engine.sequence import FinishReason, SamplingParams
from workers.engine.simulated import SimulatedRunner
from workers.protocol import (
    Abort,
    Add,
    FrameDecoder,
    Message,
    ProtocolError,
    Ready,
    SequenceFinished,
    Tokens,
    Usage,
    encode,
)

STATS_INTERVAL = 0.2
STOPS = (FinishReason.EOS, FinishReason.STOP_TOKEN)  # ended by a stop token: its id is not sent
READ_LIMIT = 1 << 20
BAD_START, PROTOCOL_FAULT = 2, 2


def load_runner(args: argparse.Namespace) -> tuple[Runner, str]:
    """The runner the command line names, and the model name ``ready`` announces."""
    size = {"block_size": args.block_size, "num_blocks": args.num_blocks, "kv_memory_gb": args.kv_memory_gb}
    if args.simulated:
        runner = SimulatedRunner(
            PRESETS[args.simulated], eos_prob=args.sim_eos_prob, wait=time.sleep, vocab=args.sim_vocab, **size
        )
        return runner, f"sim-{args.simulated}"
    import torch  # imported only by a real engine

    from workers.engine.cpu.allocator import keep_freed_memory
    from workers.engine.runner import ModelRunner

    if args.threads < 1:
        raise ValueError(f"--threads: expected >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device, **size)
    return runner, os.path.basename(os.path.normpath(args.model))


def engine_main(args: argparse.Namespace, protocol_in: int, protocol_out: int) -> int:
    """The engine worker: load the model, say `ready`, serve frames until EOF; its exit code."""
    try:
        runner, name = load_runner(args)
        config = EngineConfig(
            block_size=runner.block_size,
            num_blocks=runner.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_seqs=args.max_seqs,
            watermark=args.watermark,
            model_version=args.model_version or name,
        )
    except ValueError as exc:
        print(f"engine worker: {exc}", file=sys.stderr)
        return BAD_START
    engine = Engine(runner, config)
    with os.fdopen(protocol_out, "wb") as out:
        out.write(encode(Ready(pid=os.getpid(), model=name)))
        out.flush()
        try:
            run(engine, protocol_in, out)
        except ProtocolError as exc:
            print(f"engine worker: protocol fault: {exc}", file=sys.stderr)
            return PROTOCOL_FAULT
    return 0


def run(engine: Engine, protocol_in: int, out: BinaryIO, clock: Callable[[], float] = time.monotonic) -> None:
    """Serve frames from ``protocol_in`` until EOF (see the module's docstring)."""
    decoder = FrameDecoder()
    poller = select.poll()
    poller.register(protocol_in, select.POLLIN)
    next_stats = clock()
    while True:
        timeout = 0.0 if engine.has_work else max(0.0, next_stats - clock()) * 1000
        taken = 0
        while taken < READ_LIMIT and poller.poll(timeout):
            data = os.read(protocol_in, 1 << 16)
            if not data:
                return
            taken, timeout = taken + len(data), 0.0
            for message in decoder.feed(data):
                handle(engine, message)
        frames = step_frames(engine.step()) if engine.has_work else []
        if clock() >= next_stats:
            frames.append(encode(engine.stats()))
            next_stats = clock() + STATS_INTERVAL
        if frames:
            out.write(b"".join(frames))
            out.flush()


def handle(engine: Engine, message: Message) -> None:
    if isinstance(message, Abort):
        engine.abort(message.rid)
        return
    if not isinstance(message, Add):
        raise ProtocolError(f"unexpected {message.kind} frame")
    try:
        sampling = SamplingParams(
            max_tokens=message.max_tokens,
            temperature=message.temperature,
            top_p=message.top_p,
            top_k=message.top_k,
            seed=message.seed,
            stop_token_ids=tuple(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
        )
        engine.add(message.prompt_tokens, sampling, tier=message.tier, tenant=message.tenant, rid=message.rid)
    except ValueError as exc:
        raise ProtocolError(f"add {message.rid} refused: {exc}") from None


def step_messages(output: StepOutput) -> list[Tokens | SequenceFinished]:
    """A step's frames: every new token, then every sequence that ended (its last token first).

    A stop token (end-of-sequence, or one of the request's stop ids) is not sent: it is not text,
    and ``finished`` counts it in the usage. Leaving it out here, where the step is known, keeps
    the pool from having to tell a stop id from text by where a frame falls in what it read. The
    simulated engine process of ``batcher.sim`` hands these same messages to the pool unencoded.
    """
    stopped = {done.rid for done in output.finished if done.reason in STOPS}
    messages: list[Tokens | SequenceFinished] = [
        Tokens(rid=rid, ids=[token]) for rid, token in output.tokens.items() if rid not in stopped
    ]
    messages += map(finished_message, output.finished)
    return messages


def finished_message(done: SequenceEnd) -> SequenceFinished:
    """The ``finished`` frame of a sequence that ended, with its usage."""
    usage = Usage(done.prompt_tokens, done.cached_tokens, done.output_tokens)
    return SequenceFinished(rid=done.rid, reason=done.reason.value, usage=usage)


def step_frames(output: StepOutput) -> list[bytes]:
    """:func:`step_messages` encoded; a sequence too long for the cache is explained on stderr."""
    for done in output.finished:
        if done.detail:
            print(f"engine worker: rid {done.rid} {done.reason.value}: {done.detail}", file=sys.stderr)
    return [encode(message) for message in step_messages(output)]
