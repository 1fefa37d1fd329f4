"""The decode-attention kernel for bfloat16 on AVX-512 CPUs: built ahead by ``make``, loaded by
the engine where it can run, and torch's ``scaled_dot_product_attention`` everywhere else.

    python -m workers.engine.cpu.decode_kernel     build it (``make`` does; quick when up to date)

torch's CPU attention reads K and V at a fraction of the memory bandwidth at decode sizes;
``decode_attention.cpp`` does one pass over a head's keys for all its query rows and one over
its values, in float32 registers, stopping at each sequence's length (docs/engine.md; measured
in experiments/docs/engine-vs-vllm.md). It is the only C++ in ferry, compiled with the system's
compiler against the installed torch into ``build/`` (an installed wheel: the user's cache,
``~/.cache/ferry/kernels``, beside converted models). The engine uses it for bfloat16 decode
groups on an AVX-512 CPU with heads it takes; :func:`load` says which, once per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

from workers.engine.attention import DecodeAttention

SOURCE = Path(__file__).with_name("decode_attention.cpp")
_ROOT = Path(__file__).resolve().parents[3]  # a checkout's root, or site-packages for a wheel
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry"
BUILD = (_ROOT / "build" if (_ROOT / "pyproject.toml").is_file() else _CACHE) / "kernels"
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq",
         "-mavx512vl", "-mfma"]

def library() -> Path:
    """Where the library built for this torch lives (one per torch version: its C++ ABI)."""
    return BUILD / f"decode_attention-torch{torch.__version__.replace('+', '-')}.so"


def build() -> Path:
    """Compile the kernel unless the library is newer than its source; its path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = library()
    if target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    includes = [f"-I{path}" for path in include_paths()]
    libraries = [flag for path in library_paths() for flag in (f"-L{path}", f"-Wl,-rpath,{path}")]
    partial = target.with_suffix(".partial")
    command = ["c++", *FLAGS, abi, *includes, str(SOURCE), "-o", str(partial), *libraries, "-lc10",
               "-ltorch_cpu"]
    subprocess.run(command, check=True)
    partial.replace(target)  # whole or not at all: an engine starting meanwhile never loads half a file
    return target


@functools.cache
def load() -> DecodeAttention | None:
    """The kernel as ``torch.ops.ferry.decode_attention``, or None where it cannot run here."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not library().exists():
        return None
    torch.ops.load_library(str(library()))
    return torch.ops.ferry.decode_attention


HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_GROUP = 16  # query heads per KV head


def usable(dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> DecodeAttention | None:
    """The kernel for a model of ``dtype`` on ``device`` with heads of ``head_dim`` shared
    ``group`` to a KV head, or None (attend with torch)."""
    fits = dtype == torch.bfloat16 and device.type == "cpu" and head_dim in HEAD_DIMS and group <= MAX_GROUP
    return load() if fits else None


def main() -> int:
    """Build; a machine without a C++ compiler is told so and goes on without the kernel."""
    try:
        print(f"decode kernel: {build()}", file=sys.stderr)
    except FileNotFoundError:
        print("decode kernel: no C++ compiler (c++); the engine attends with torch", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
