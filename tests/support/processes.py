"""What a test can see of a worker's OS process from outside, by its pid (Linux ``/proc``): whether
it lives, whether it is gone, its worker program, and what it has written."""

from __future__ import annotations

import os
import pathlib


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pid: int) -> bool:
    """True once the process has exited and been reaped: a zombie is not gone, so a parent that
    never waits for its dead children is seen to leak them."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def worker_pids(backend) -> list[int]:
    """The pid of each worker of a backend, slot by slot, as its snapshot (and ``/readyz``) says."""
    return [worker.pid for worker in backend.snapshot().status.workers]


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (a Ray actor's host process and its worker program)."""
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [pid, *(p for child in children.read().split() for p in process_tree(int(child)))]


def worker_program(pid: int) -> int:
    """The ``python -m workers`` program at ``pid`` or under it (a Ray actor runs it as a child)."""
    for candidate in process_tree(pid):
        argv = pathlib.Path(f"/proc/{candidate}/cmdline").read_bytes().split(b"\0")
        if argv[1:3] == [b"-m", b"workers"]:
            return candidate
    raise AssertionError(f"no worker program in the process tree of pid {pid}")


def bytes_written(pid: int) -> int:
    """Every byte the process has written so far (``wchar`` of ``/proc/PID/io``). A fixed-mode
    worker writes nothing between its frames, so growth after its ``ready`` is its ``accepted``
    of a call: the call is the worker's from then on."""
    for line in pathlib.Path(f"/proc/{pid}/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "wchar":
            return int(value)
    raise AssertionError(f"/proc/{pid}/io has no wchar")
