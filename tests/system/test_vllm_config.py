"""A model's workers under another Python (``python = ...``), and ``engine = "vllm"`` in a model
table: refused at start with one line naming the model when that interpreter cannot run them,
and a real worker under vLLM's own virtualenv where ``make vllm-env`` has built it."""

from __future__ import annotations

import pytest
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.engine_process import check_interpreter
from batcher.fixed.worker import ProcessWorker
from batcher.placement.local import process_workers
from gateway.config import parse_config
from tests.support.vllm_server import VLLM_PYTHON, vllm_installed
from workers.protocol import RunBatch

MODEL = """
[[tiers]]
name = "paid"
[[models]]
name = "chat@1"
mode = "continuous"
model = "{model}"
{extra}
"""


def test_an_interpreter_that_is_not_there_is_refused_naming_the_model_and_the_field(tiny_checkpoint):
    with pytest.raises(ValueError) as refused:
        parse_config(MODEL.format(model=tiny_checkpoint, extra='python = "/no/such/python"'), "ferry.toml")
    assert str(refused.value) == ("ferry.toml: models[0].python: expected an executable Python interpreter"
                                  " for model 'chat@1''s workers, got '/no/such/python'")


def test_an_unknown_engine_and_a_simulated_vllm_are_refused(tiny_checkpoint):
    unknown = r"models\[0\]\.engine: expected one of \['ferry', 'vllm'\], got 'tgi'"
    with pytest.raises(ValueError, match=unknown):
        parse_config(MODEL.format(model=tiny_checkpoint, extra='engine = "tgi"'), "ferry.toml")
    with pytest.raises(ValueError, match="engine: expected 'ferry' for a simulated model"):
        ContinuousModelConfig(name="sim@1", simulated="llama-70b", engine="vllm")


async def test_a_vllm_model_under_a_python_without_vllm_fails_to_start_saying_which_and_why(tiny_checkpoint):
    config = ContinuousModelConfig(name="chat@1", model=str(tiny_checkpoint), engine="vllm")
    with pytest.raises(ValueError) as refused:
        await check_interpreter(config)
    assert "cannot run the vllm engine of 'chat@1'" in str(refused.value)
    assert "make vllm-env" in str(refused.value)


@pytest.mark.skipif(not vllm_installed(), reason="vLLM's virtualenv .venv-vllm is not built (make vllm-env)")
async def test_a_worker_runs_under_the_interpreter_its_model_names():
    config = ContinuousModelConfig(name="chat@1", simulated="llama-70b", python=str(VLLM_PYTHON))
    worker = process_workers(["echo"], 1, python=config.interpreter, kind=ProcessWorker)(0)
    try:
        with trio.fail_after(60):
            await worker.start()
            reply = await worker.call(RunBatch(id=1, inputs=["abc"]))
        assert reply.outputs == ["abc"]
        command = (await trio.Path(f"/proc/{worker.pid}/cmdline").read_bytes()).split(b"\0")
        assert command[:3] == [str(VLLM_PYTHON).encode(), b"-m", b"workers"]
    finally:
        await worker.stop()


def test_compile_is_for_vllm_only_and_threads_and_compile_reach_a_vllm_worker(tiny_checkpoint):
    with pytest.raises(ValueError, match=r'models\[0\]\.compile: expected false unless engine = "vllm"'):
        parse_config(MODEL.format(model=tiny_checkpoint, extra="compile = true"), "ferry.toml")
    config = ContinuousModelConfig(name="chat@1", model=str(tiny_checkpoint), engine="vllm", threads=2,
                                   compile=True)
    argv = config.engine_argv()
    assert argv[0] == "vllm-engine"
    assert argv[argv.index("--threads") + 1] == "2" and "--compile" in argv
    assert "--compile" not in ContinuousModelConfig(name="chat@1", model=str(tiny_checkpoint)).engine_argv()
