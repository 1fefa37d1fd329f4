"""``python -m workers KIND [options]``: one worker process, speaking the framed protocol.

The protocol runs over the process's stdin and stdout, but model code does not get to touch
them: at start-up the worker moves the protocol onto private descriptors, points fd 1 at stderr
and fd 0 at /dev/null. A stray ``print`` (or a C library writing to fd 1) then lands in the log
instead of corrupting a frame. The private descriptors are not inherited by children.

The loop is deliberately plain and blocking: one call at a time, exactly like a GPU (the
``engine`` kind runs its own loop instead, one decode step at a time: ``workers/engine/serve.py``). The worker
exits when the pool closes its stdin, and also when its parent disappears (a watchdog thread
notices re-parenting), so a killed gateway never leaves workers behind.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import sys
import threading
import time
import traceback

from workers import api
from workers.engine_arguments import add_engine_arguments, add_vllm_arguments
from workers.faults import Fault, FaultInjector, add_fault_arguments, instance_from_env, plan_from_args
from workers.models import add_model_arguments, target_of
from workers.protocol import (
    Accepted,
    Error,
    FrameDecoder,
    Message,
    Ready,
    Result,
    RunBatch,
    Skip,
    Unloadable,
    encode,
)

CRASH_EXIT_CODE = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    add_model_arguments(kinds)
    for sub in kinds.choices.values():
        add_fault_arguments(sub)
    add_engine_arguments(kinds)  # continuous mode: its own loop (workers/engine/serve.py)
    add_vllm_arguments(kinds)  # the same frames over vLLM's engine (workers/vllm_engine.py)
    return parser


def claim_protocol_fds() -> tuple[int, int]:
    """Move the protocol off fds 0 and 1; return the private (read, write) descriptors."""
    protocol_in, protocol_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return protocol_in, protocol_out


def exit_with_parent(interval: float = 0.5) -> None:
    """Exit as soon as the process that started us is gone, even in the middle of a call."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


GARBAGE = b"\x00\x00\x00\x03\xc1\xc1\xc1"  # a frame of 3 bytes that no msgpack decoder accepts


def serve_call(model: api.Model, injector: FaultInjector, call: RunBatch) -> bytes:
    """Run one call with whatever fault the plan injects into it; the answer's frame."""
    fault = injector.next_call(call.inputs)
    if injector.plan.chatter:
        print(f"chatter: call {injector.calls} with {len(call.inputs)} inputs", flush=True)
        os.write(1, b"\x00\x00\x00\x05raw bytes on fd 1\n")
    if fault is Fault.CRASH:
        os._exit(CRASH_EXIT_CODE)
    if fault is Fault.HANG:
        while True:
            time.sleep(3600)
    started = time.monotonic()
    try:
        if fault is Fault.POISON:
            raise ValueError(injector.poison_message(call.inputs))
        reply = api.result(call.id, model.run_batch(call.inputs))
    except Exception as exc:  # noqa: BLE001 - the model's failure is the call's, not the worker's
        return encode(Error(id=call.id, message=f"{type(exc).__name__}: {exc}"))
    if injector.plan.slow_factor != 1.0:
        time.sleep((injector.plan.slow_factor - 1.0) * (time.monotonic() - started))
    if fault is Fault.WRONG_COUNT:
        reply = Result(id=call.id, outputs=reply.outputs[:-1], vectors=reply.vectors[:-1])
    if fault is Fault.GARBAGE:
        return GARBAGE
    return encode(reply)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "vllm-engine":  # before the pipes move off fds 0 and 1: they stay across an exec
        from workers.vllm_preload import exec_with_preloads

        exec_with_preloads(sys.argv[1:] if argv is None else argv)
    protocol_in, protocol_out = claim_protocol_fds()
    exit_with_parent()
    if args.kind == "engine":  # an engine is imported only by the worker that runs it
        from workers.engine.serve import engine_main

        return engine_main(args, protocol_in, protocol_out)
    if args.kind == "vllm-engine":
        from workers.vllm_engine import vllm_main

        return vllm_main(args, protocol_in, protocol_out)
    injector = FaultInjector(plan_from_args(args), instance_from_env())
    target, options, pythonpath = target_of(args)
    with os.fdopen(protocol_out, "wb") as out:
        try:
            model = api.build(target, options, pythonpath, api.slot_device())
        except Exception as exc:  # noqa: BLE001 - any failure of the user's code is a start error
            traceback.print_exc()  # the log's; the pool hears the type and message alone
            out.write(encode(Unloadable(message=f"{type(exc).__name__}: {exc}"[:2000])))
            out.flush()
            return 1
        out.write(encode(Ready(pid=os.getpid(), model=api.model_name(model, target))))
        out.flush()
        try:
            return serve_calls(model, injector, protocol_in, out)
        finally:
            api.close(model)


def serve_calls(model: api.Model, injector: FaultInjector, protocol_in: int, out) -> int:
    """Answer calls one at a time until the pool closes the pipe (0) or breaks the protocol (2).
    A call sent while the one before it ran waits in the pipe; before it starts, whatever else
    has arrived is read, so that a ``skip`` of its inputs is honoured."""
    frames = _Frames(protocol_in)
    while (message := frames.next()) is not None:
        if isinstance(message, Skip):
            continue  # of a call that has already run: too late
        if not isinstance(message, RunBatch):
            print(f"worker: unexpected {message.kind} frame", file=sys.stderr)
            return 2
        skipped = frames.skips(message.id)
        inputs = [text for position, text in enumerate(message.inputs) if position not in skipped]
        out.write(encode(Accepted(id=message.id, skipped=sorted(skipped))))  # before any fault: ours now
        out.flush()
        if inputs or not message.inputs:
            out.write(serve_call(model, injector, RunBatch(message.id, inputs) if skipped else message))
        else:  # every caller has gone: nothing to run
            out.write(encode(Result(id=message.id, outputs=[])))
        out.flush()
    return 0


class _Frames:
    """The pool's frames, in order, from the protocol's descriptor."""

    def __init__(self, protocol_in: int) -> None:
        self._fd = protocol_in
        self._decoder = FrameDecoder()
        self._waiting: collections.deque[Message] = collections.deque()
        self._closed = False

    def next(self) -> Message | None:
        """The next frame (blocking); None once the pool has closed the pipe."""
        while not self._waiting:
            if self._closed or not self._read():
                return None
        return self._waiting.popleft()

    def skips(self, call: int) -> set[int]:
        """The positions of ``call`` that the frames already sent say to skip (those frames are
        taken; the others stay in order)."""
        while not self._closed and select.select([self._fd], [], [], 0)[0]:
            self._read()
        positions: set[int] = set()
        for message in [m for m in self._waiting if isinstance(m, Skip) and m.id == call]:
            self._waiting.remove(message)
            positions.update(message.positions)
        return positions

    def _read(self) -> bool:
        data = os.read(self._fd, 1 << 16)
        if not data:
            self._closed = True
            return False
        self._waiting.extend(self._decoder.feed(data))
        return True


if __name__ == "__main__":
    sys.exit(main())
