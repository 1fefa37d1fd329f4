"""ferry's C++ CPU kernels (``csrc/``), built ahead by ``make kernels`` into one library with an
AVX-512 and an AVX2 version of each, the one for the ISA torch runs here used; where neither
can run, the engine computes with torch.

    python -m workers.engine.cpu.kernels     build it (``make`` does; quick when up to date)

What they do and why: paged attention that reads the KV blocks in place with RoPE applied as it
loads Q and K (``paged_attention.cpp``); a decoder layer's small operators fused, one pass each
instead of a handful of torch operators and their dispatch (``elementwise.cpp``: the residual add
with the RMSNorm after it, SiLU of the gate times up). They take bfloat16 and float32 (docs/engine.md, "On a
CPU"; measured in experiments/docs/engine-step.md). Compiled with the system's C++ compiler
against the installed torch into ``build/`` (an installed wheel: the user's cache,
``~/.cache/ferry/kernels``, beside converted models).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCES = Path(__file__).with_name("csrc")
_ROOT = Path(__file__).resolve().parents[3]  # a checkout's root, or site-packages for a wheel
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry"
BUILD = (_ROOT / "build" if (_ROOT / "pyproject.toml").is_file() else _CACHE) / "kernels"
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-fmax-errors=5")
ISAS = {  # torch's name for a CPU capability -> the kernels' namespace for it, and its flags
    "AVX512": ("avx512", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma")),
    "AVX2": ("avx2", ("-mavx2", "-mfma")),
}
OPERATORS = ("paged_attention", "add_rms_norm", "silu_mul")  # as Kernels' fields, each per ISA
BINDING = "ops.cpp"  # checks the tensors and registers the operators; compiled once, for any x86-64


def namespace() -> str:
    """The operators' namespace: a digest of the sources and flags, so that the library is built
    again when either changes, and two versions of the sources (experiments/engine_step.py loads
    an earlier commit's beside this tree's) never register the same names."""
    digest = hashlib.sha256(repr((FLAGS, ISAS)).encode())
    for source in sorted(SOURCES.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return f"ferry_{digest.hexdigest()[:12]}"


def library() -> Path:
    """Where the library built for this torch lives (one per torch version: its C++ ABI)."""
    return BUILD / f"{namespace()}-torch{torch.__version__.replace('+', '-')}.so"


def build() -> Path:
    """Compile the library unless it is built; its path. The kernel sources include no heavy
    torch header, so only :data:`BINDING` takes long, and the sources compile in parallel."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = library()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    common = [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
              f"-DFERRY_OPS={namespace()}", *(f"-I{path}" for path in include_paths())]
    jobs: list[tuple[Path, str, tuple[str, ...]]] = [(SOURCES / BINDING, "binding", ())]
    for name, flags in ISAS.values():
        jobs += [(source, name, flags) for source in sorted(SOURCES.glob("*.cpp")) if source.name != BINDING]

    def compile_one(job: tuple[Path, str, tuple[str, ...]]) -> Path:
        source, isa, flags = job
        obj = target.with_name(f"{target.stem}-{source.stem}-{isa}.o")
        command = ["c++", *common, *flags, f"-DFERRY_ISA={isa}", "-c", str(source), "-o", str(obj)]
        subprocess.run(command, check=True)
        return obj

    with ThreadPoolExecutor() as pool:
        objects = list(pool.map(compile_one, sorted(jobs, key=lambda job: job[0].name != BINDING)))
    libraries = [flag for path in library_paths() for flag in (f"-L{path}", f"-Wl,-rpath,{path}")]
    partial = target.with_suffix(".partial")
    subprocess.run(["c++", "-shared", "-fopenmp", *map(str, objects), "-o", str(partial), *libraries, "-lc10",
                    "-ltorch_cpu"], check=True)
    for obj in objects:
        obj.unlink()
    partial.replace(target)  # whole or not at all: an engine starting meanwhile never loads half a file
    return target


@dataclasses.dataclass(frozen=True, slots=True)
class Kernels:
    """The operators of one ISA (each documented in ``csrc/ops.cpp`` and its source file); the
    elementwise ones as :class:`~workers.engine.model.Elementwise` methods."""

    isa: str
    paged_attention: Callable[..., torch.Tensor]
    _add_rms_norm: Callable[..., torch.Tensor]
    _silu_mul: Callable[[torch.Tensor], torch.Tensor]

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (``residual`` itself, written in place) and its RMSNorm times ``weight``."""
        return self._add_rms_norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU of the first half of each row times its second half."""
        return self._silu_mul(gate_up)


def load(capability: str | None = None) -> Kernels | None:
    """The kernels for ``capability`` (default: torch's here, ``AVX512`` or ``AVX2``), or None where
    there are none, or where the library was not built."""
    return _load(capability or torch.backends.cpu.get_cpu_capability())


def runnable() -> list[str]:
    """The capabilities whose kernels this CPU runs (AVX-512 runs AVX2's too)."""
    here = torch.backends.cpu.get_cpu_capability()
    return [name for name in ISAS if name == here or (name, here) == ("AVX2", "AVX512")]


@functools.cache
def _load(capability: str) -> Kernels | None:
    if capability not in ISAS or not library().exists():
        return None
    torch.ops.load_library(str(library()))
    ops, isa = getattr(torch.ops, namespace()), ISAS[capability][0]
    return Kernels(isa, *(getattr(ops, f"{name}_{isa}") for name in OPERATORS))


def usable(dtype: torch.dtype, device: torch.device) -> Kernels | None:
    """The kernels for a model of ``dtype`` on ``device``, or None (compute with torch)."""
    fits = dtype in (torch.bfloat16, torch.float32) and device.type == "cpu"
    return load() if fits else None


def main() -> int:
    """Build; a machine without a C++ compiler is told so and goes on without the kernels."""
    try:
        print(f"kernels: {build()}", file=sys.stderr)
    except FileNotFoundError:
        print("kernels: no C++ compiler (c++); the engine computes with torch", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
