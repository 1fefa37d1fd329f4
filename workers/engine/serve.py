"""``python -m workers engine``: the continuous engine behind the framed pipe (workers/protocol.py).

The process shell of the serving loop (:mod:`workers.engine.loop`). While the engine has work,
each turn takes whatever frames have already arrived (``poll`` with timeout 0, at most 1 MiB
besides the frame in progress, so a flood of ``add`` frames cannot stall running decodes; a
hand-off's ``kv`` bytes do not count: they are copied, not computed, and at most the cache's
worth waits, so a long prompt's KV is not spread over hundreds of steps), runs one step, and
writes that step's ``tokens`` and ``finished`` frames, plus ``stats`` when 200 ms have passed, in
one write; a step that should be long is announced (``step``, written as it starts: see
:mod:`workers.engine.step_forecast`). A hand-off midway (a frame part-read, or ``kv`` frames
without their ``kv_handoff``) is read to its end first, each read waiting for the next bytes
(:meth:`~workers.engine.loop.EngineLoop.read_wait`): the pool writes a hand-off in one go, but
a pipe holds 64 KiB, and a poll that found it momentarily empty would step, one pipe's worth
a step (experiments/docs/continuous-pd.md).
While idle it blocks on the pipe, waking only to send ``stats``. EOF on the pipe ends it (exit
0); the parent watchdog of ``workers/__main__.py`` ends it when the gateway dies.

A frame that breaks the protocol (see the loop) exits 2: the gateway validates requests, so
these are the pool's bugs, and the pool treats that like a crash and restarts the worker.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections.abc import Callable
from typing import BinaryIO, cast

from workers.engine.batch import Runner
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS, CostModel
from workers.engine.engine import Engine
from workers.engine.fit import cost_fit
from workers.engine.interface import EngineCore, StepOutput
from workers.engine.kv_transfer import KvCache, KvTransfer
from workers.engine.loop import EngineLoop, Handoffs, step_messages
from workers.engine.simulated import SimulatedRunner
from workers.engine.step_forecast import StepForecast
from workers.faults import instance_from_env
from workers.protocol import FrameDecoder, KvBlocks, ProtocolError, Ready, encode

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
    model = ModelRunner(args.model, dtype=args.dtype, device=args.device, weights=args.weights, **size)
    return model, os.path.basename(os.path.normpath(args.model))


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
        cost = step_costs(args)
    except ValueError as exc:
        print(f"engine worker: {exc}", file=sys.stderr)
        return BAD_START
    engine = Engine(runner, config, cost=cost)
    handoffs = None
    if not args.simulated:  # a model's runner: its cache is read and written by block
        cache = cast(KvCache, runner)
        handoffs = KvTransfer(engine, cache, prefill=prefills(args.prefill_slots), shm=args.kv_shm)
    return serve(engine, name, protocol_in, protocol_out, "engine worker", handoffs, cost)


def step_costs(args: argparse.Namespace) -> CostModel | None:
    """The prices that hold the sequences' TPOT targets: ``--step-costs``, else a simulated
    engine's own preset, else none (targets are not held)."""
    if args.step_costs:
        try:
            return cost_fit.load(args.step_costs)
        except OSError as exc:
            raise ValueError(f"--step-costs: {exc.strerror}: {args.step_costs}") from None
    return PRESETS[args.simulated] if args.simulated else None


def prefills(prefill_slots: int) -> bool:
    """Whether this worker runs prefill only: its slot (the pool's, in its environment) is below
    ``prefill_slots``."""
    instance = instance_from_env()
    return instance is not None and int(instance.split(":")[0]) < prefill_slots


def serve(engine: EngineCore, name: str, protocol_in: int, protocol_out: int, who: str,
          handoffs: Handoffs | None = None, cost: CostModel | None = None) -> int:
    """Say ``ready`` as model ``name``, then :func:`run` until EOF; the worker's exit code (a frame
    that breaks the protocol is told on stderr, as ``who``). ``cost`` prices the steps it
    announces, beside what it measures of them."""
    with os.fdopen(protocol_out, "wb") as out:
        out.write(encode(Ready(pid=os.getpid(), model=name)))
        out.flush()
        try:
            run(engine, protocol_in, out, handoffs=handoffs, cost=cost)
        except ProtocolError as exc:
            print(f"{who}: protocol fault: {exc}", file=sys.stderr)
            return PROTOCOL_FAULT
    return 0


def run(
    engine: EngineCore, protocol_in: int, out: BinaryIO, clock: Callable[[], float] = time.monotonic,
    handoffs: Handoffs | None = None, cost: CostModel | None = None,
) -> None:
    """Serve frames from ``protocol_in`` until EOF (see the module's docstring)."""
    decoder = FrameDecoder()
    poller = select.poll()
    poller.register(protocol_in, select.POLLIN)

    def announce(seconds: float) -> None:
        out.write(encode(loop.announce(seconds)))
        out.flush()

    loop = EngineLoop(engine, clock(), handoffs, StepForecast(announce, clock, cost))
    while True:
        timeout = loop.read_wait(clock(), decoder.pending) * 1000
        taken = 0
        while taken - decoder.pending < READ_LIMIT and poller.poll(timeout):
            data = os.read(protocol_in, 1 << 16)
            if not data:
                return
            messages = decoder.feed(data)
            moved = sum(len(message.data) for message in messages if isinstance(message, KvBlocks))
            taken = taken + len(data) - moved
            loop.take(messages)
            timeout = loop.read_wait(clock(), decoder.pending, more=True) * 1000
        output = loop.step()
        frames = [] if output is None else step_frames(output)
        if output is not None and handoffs is not None:
            frames += map(encode, handoffs.exports(output))  # after the step's tokens
        stats = loop.stats(clock())
        if stats is not None:
            frames.append(encode(stats))
        if frames:
            out.write(b"".join(frames))
            out.flush()


def step_frames(output: StepOutput) -> list[bytes]:
    """:func:`~workers.engine.loop.step_messages` encoded; a sequence too long for the cache is
    explained on stderr."""
    for done in output.finished:
        if done.detail:
            print(f"engine worker: rid {done.rid} {done.reason.value}: {done.detail}", file=sys.stderr)
    return [encode(message) for message in step_messages(output)]
