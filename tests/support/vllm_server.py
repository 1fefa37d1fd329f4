"""vLLM's own OpenAI-compatible server on loopback, from the virtualenv ``make vllm-env`` builds: the
peer that ferry's vLLM engine workers are checked against (tests/system/test_vllm_engine.py) and measured
against (experiments/vllm_bench.py), started as vLLM's CPU guide says and as ferry's vLLM workers start
(workers/vllm_preload.py). Started on a free port, waited for until ``/health`` answers, stopped with
SIGTERM (SIGKILL if it lingers)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import urllib.error
import urllib.request

from tests.support.redis_server import free_port
from tests.support.waiting import until
from workers.vllm_preload import preload_env

ROOT = pathlib.Path(__file__).parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {  # what ferry's vLLM engine worker sets too (workers/vllm_engine.py), for a like-for-like peer
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def vllm_installed() -> bool:
    """Whether ``make vllm-env`` has built vLLM's virtualenv here."""
    return (ROOT / ".venv-vllm" / ".installed").exists()


class VllmOpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` for one model directory."""

    def __init__(self, model: str, log: pathlib.Path, kv_memory_gb: int = 1, max_model_len: int = 2048,
                 eager: bool = True, max_batch_tokens: int = 2048) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
                     "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(max_batch_tokens),
                     "--max-num-seqs", "256",
                     "--enable-prefix-caching"] + (["--enforce-eager"] if eager else [])
        environ = {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_memory_gb)}
        self.env = preload_env(environ, VLLM_PYTHON.parent.parent)  # as ferry's vLLM workers start
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            until(self._healthy, "vLLM's server to answer /health", within=timeout, every=0.5)
        except (AssertionError, RuntimeError):
            self.stop()
            log = self.log.read_text()[-2000:]
            raise RuntimeError(f"vLLM's server did not start; its log: {log}") from None

    def _healthy(self) -> bool:
        """200 on ``/health``; a server that has exited never will (RuntimeError at once)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            if self.process.poll() is not None:  # type: ignore[union-attr]
                raise RuntimeError("vLLM's server exited") from None
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
