"""The side-by-side benchmark stops a server with everything it started: a child that outlives its
parent's exit (as vLLM's engine core outlived its API server's) must not share the cores with the
next server's round."""

import pathlib
import subprocess

from experiments.vllm_bench import descendants, stop_quietly


def test_a_server_stopped_leaves_no_child_behind():
    # A parent whose two children ignore its exit: SIGTERM ends the shell, not the sleeps.
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    children: set[int] = set()
    while len(children) < 2:
        children = descendants(parent.pid)

    def stop():
        parent.terminate()
        parent.wait(10)

    found = stop_quietly("test", parent.pid, stop, quiet=1.0)

    assert found["left_over"] == {"sleep": 2}
    assert not [pid for pid in children if pathlib.Path(f"/proc/{pid}").exists()]
