"""Settings the core takes, and the models a config file serves, as frozen dataclasses that
check themselves.

Every bad value raises ``ValueError`` naming the field and the value, so a typo in a config file
or a command line reads as one clear line, not a traceback from deep inside the scheduler. A
file's tables become these by :mod:`batcher.core.config_file`; the file as a whole (server, keys,
limits, aliases...) and its TOML loading are the gateway's (:mod:`gateway.config`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

from batcher.fixed.policy import POLICIES, Policy, make_policy


def _require(condition: bool, field: str, expected: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueConfig:
    """How requests wait: tiers in priority order, their deadline, and aging of lower tiers."""

    tiers: tuple[str, ...] = ("paid", "free")
    queue_timeout: float = 30.0  # a request not dispatched this long after arrival: Overloaded
    age_limit: float = 1.0  # a lower-tier request this old is aged...
    aged_share: float = 0.1  # ...and aged requests may take this share of dispatched slots
    wait_budgets: tuple[float, ...] | None = None  # seconds per tier; set: shed over-budget arrivals

    def __post_init__(self) -> None:
        _require(len(self.tiers) >= 1, "tiers", "at least one tier", self.tiers)
        _require(len(set(self.tiers)) == len(self.tiers), "tiers", "distinct names", self.tiers)
        _require(self.queue_timeout > 0, "queue_timeout", "seconds > 0", self.queue_timeout)
        _require(self.age_limit > 0, "age_limit", "seconds > 0", self.age_limit)
        _require(0.0 <= self.aged_share <= 1.0, "aged_share", "a share in 0..1", self.aged_share)
        if self.wait_budgets is not None:
            budgets = self.wait_budgets
            _require(
                len(budgets) == len(self.tiers), "wait_budgets", f"one per tier ({len(self.tiers)})", budgets
            )
            _require(all(b > 0 for b in budgets), "wait_budgets", "seconds > 0", budgets)

    def deadline(self, tier: int) -> float:
        """Seconds a request of this tier may wait for dispatch: its budget, else the timeout."""
        return self.queue_timeout if self.wait_budgets is None else self.wait_budgets[tier]

    def tier_index(self, name: str) -> int:
        """Position of a tier by name: 0 is served first."""
        try:
            return self.tiers.index(name)
        except ValueError:
            raise ValueError(f"tier: expected one of {list(self.tiers)}, got {name!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    """How many workers, and how the pool judges and repairs them."""

    workers: int = 8
    # a call running longer is a hung worker (longer if the fleet's calls are: pool.py)
    hang_timeout: float = 1.0
    max_attempts: int = 3  # tries of one batch before it is split; of one input before it fails
    start_timeout: float = 120.0  # from spawn to `ready` (model load)
    restart_backoff: float = 0.1  # first wait before a restart; doubles on each failed start
    max_restart_backoff: float = 5.0
    model: str = "the pool"  # the model version these workers serve: errors name it

    def __post_init__(self) -> None:
        _require(1 <= self.workers <= 4096, "workers", "1..4096", self.workers)
        for name in ("hang_timeout", "start_timeout"):
            value = getattr(self, name)
            _require(0 < value < math.inf, name, "a finite number of seconds > 0", value)
        _require(1 <= self.max_attempts <= 16, "max_attempts", "1..16", self.max_attempts)
        _require(self.restart_backoff >= 0, "restart_backoff", "seconds >= 0", self.restart_backoff)
        _require(
            self.max_restart_backoff >= self.restart_backoff,
            "max_restart_backoff",
            f"seconds >= restart_backoff ({self.restart_backoff})",
            self.max_restart_backoff,
        )


TOKENIZERS = ("bytes",)  # built in; any other value names a tokenizer.json (gateway/text/tokenizer.py)
CHAT_TEMPLATES = ("labelled", "model")  # built in; any other value names a .jinja file (gateway/text/chat.py)


def _check_tokenizer(spec: str) -> None:
    """``bytes``, or a Hugging Face tokenizer.json (or a directory holding one) that exists."""
    path = os.path.expanduser(spec)
    found = spec in TOKENIZERS or os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
    _require(found, "tokenizer", "'bytes' or a path to a tokenizer.json (or a directory with one)", spec)


PLACEMENTS = ("local", "ray")


@dataclasses.dataclass(frozen=True, slots=True)
class RayConfig:
    """The Ray cluster that places ``placement = "ray"`` workers: ``address`` is ``auto`` (the
    cluster this machine has joined), ``local`` (a private one ferry starts on loopback) or
    ``host:port`` of a head node; named actors live in ``namespace``."""

    address: str = "auto"
    namespace: str = "ferry"

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        named = self.address in ("auto", "local") or (bool(host) and port.isdigit() and 0 < int(port) < 65536)
        _require(named, "address", "'auto', 'local' or host:port", self.address)
        _require(bool(self.namespace), "namespace", "a namespace name", self.namespace)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What every served model has, whatever its mode: its versioned name, aliases, context
    window, tokenizer and chat template. A model table's ``mode`` picks its class in
    :data:`batcher.core.modes.MODES`, and each mode checks only its own fields."""

    name: str
    aliases: tuple[str, ...] = ()
    mode: str
    context_window: int = 8192
    tokenizer: str = "bytes"
    chat_template: str = "labelled"
    # Where the workers run (docs/ray.md): "local" child processes, or Ray actors asking for
    # num_gpus (None: 1 on a cluster with GPUs, else 0), these custom resources and accelerator.
    placement: str = "local"
    num_gpus: float | None = None
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    accelerator_type: str = ""
    python: str = ""  # the interpreter its workers run under (a virtualenv's); '' is the gateway's own

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "a model name", self.name)
        _require(
            1 <= self.context_window <= 1 << 24, "context_window", "1..16777216 tokens", self.context_window
        )
        _require(self.placement in PLACEMENTS, "placement", f"one of {list(PLACEMENTS)}", self.placement)
        _require(self.num_gpus is None or 0 <= self.num_gpus <= 1024, "num_gpus", "0..1024", self.num_gpus)
        _require(all(0 <= v < math.inf for v in self.resources.values()), "resources", "amounts >= 0",
                 self.resources)
        if self.python:
            path = os.path.expanduser(self.python)
            _require(os.path.isfile(path) and os.access(path, os.X_OK), "python",
                     f"an executable Python interpreter for model {self.name!r}'s workers", self.python)
        self._check_files()

    @property
    def interpreter(self) -> str:
        """The Python its worker processes run: :attr:`python`, else the gateway's own."""
        return os.path.expanduser(self.python) if self.python else sys.executable

    def _check_files(self) -> None:
        """The tokenizer and template files named exist (a continuous model converted at start
        has them checked once they are written)."""
        _check_tokenizer(self.tokenizer)
        if self.chat_template not in CHAT_TEMPLATES:
            path = os.path.expanduser(self.chat_template)
            _require(
                os.path.isfile(path),
                "chat_template",
                f"one of {list(CHAT_TEMPLATES)} or a .jinja file",
                self.chat_template,
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FixedModelConfig(ModelConfig):
    """A fixed-mode model: ``run_batch`` workers and the batching in front of them."""

    mode: str = "fixed"
    worker: tuple[str, ...]
    workers: int = 8
    max_batch: int = 50
    max_wait_ms: float = 150.0
    hang_timeout_ms: float = 1000.0
    max_attempts: int = 3
    policy: str = "size_or_timeout"  # a name in batcher.fixed.policy.POLICIES
    policy_options: dict[str, float] = dataclasses.field(default_factory=dict)  # its own parameters

    def __post_init__(self) -> None:
        super(FixedModelConfig, self).__post_init__()
        _require(len(self.worker) >= 1, "worker", "argv after `python -m workers`", list(self.worker))
        _require(1 <= self.max_batch <= 1024, "max_batch", "1..1024", self.max_batch)
        _require(0 <= self.max_wait_ms < math.inf, "max_wait_ms", "milliseconds >= 0", self.max_wait_ms)
        _require(
            0 < self.hang_timeout_ms < math.inf, "hang_timeout_ms", "milliseconds > 0", self.hang_timeout_ms
        )
        self.pool()  # checks workers and max_attempts with the pool's own rules
        self.batch_policy()  # checks the policy's name and options with its own rules

    def pool(self) -> PoolConfig:
        """The pool settings of this model's fleet."""
        return PoolConfig(self.workers, self.hang_timeout_ms / 1000, self.max_attempts, model=self.name)

    def batch_policy(self) -> Policy:
        """A fresh flush policy: ``max_batch`` and ``max_wait_ms`` where it takes them, then its options."""
        implied = {"max_batch": self.max_batch, "max_wait": self.max_wait_ms / 1000}
        factory = POLICIES.get(self.policy)
        takes = (
            {f.name for f in dataclasses.fields(factory) if f.init}
            if dataclasses.is_dataclass(factory)
            else set()
        )
        params = {name: value for name, value in implied.items() if name in takes}
        return make_policy(self.policy, **params, **self.policy_options)


# --- continuous models: engine workers, one per GPU ------------------------------------------

CONVERTED = ("smollm2-135m",)
"""Model names ``ferry serve`` converts once from an installed GGUF (workers/convert.py)."""
SIMULATED = ("llama-70b", "smollm2-135m")  # workers/engine/cost_model.py: PRESETS
DTYPES = ("float32", "bfloat16")
ENGINES = ("ferry", "vllm")
"""Who runs a continuous model's steps: ferry's own engine, or vLLM's (``workers/vllm_engine.py``,
under an interpreter that has vLLM: its own virtualenv, named by ``python``)."""


def converted_dir(name: str) -> str:
    """Where the conversion of a :data:`CONVERTED` model lives (what ``--model`` is given)."""
    from workers.convert import SOURCES, models_dir  # numpy only; never gguf or torch here

    return str(models_dir() / SOURCES[name].dir_name)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContinuousModelConfig(ModelConfig):
    """A continuous-mode model: engine workers (``python -m workers engine``) behind the router.

    ``model`` is a Hugging Face model directory, or a name in :data:`CONVERTED` (converted once
    at start); ``simulated`` instead names a cost-model preset (no weights: seeded tokens, each
    step as long as the preset's GPU would take; ids are ASCII under the ``bytes`` tokenizer).
    ``tokenizer`` and ``chat_template`` default to the model's own (``bytes`` and ``labelled``
    for a simulated engine).
    """

    mode: str = "continuous"
    model: str = ""
    simulated: str = ""
    tokenizer: str = ""
    chat_template: str = ""
    workers: int = 1  # engine replicas, one per GPU
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks per replica (0: from kv_memory_gb, else the runner's default)
    kv_memory_gb: float = 0.0  # KV cache size per replica, instead of num_blocks
    max_batch_tokens: int = 512  # the token budget of one engine step
    max_seqs: int = 256  # running sequences per replica at most
    dtype: str = "float32"
    device: str = ""  # cpu or cuda (default: cuda where present)
    threads: int = 1  # torch CPU threads per engine; 1 never spins on a core the gateway needs
    compile: bool = False  # engine = "vllm": torch.compile the model (a slower start, faster steps)
    affinity_bound: int = 2048  # tokens: a prefix holder busier than the least loaded by more loses it
    stats_timeout_ms: float = 5000.0  # an engine silent this long (no stats frame) is dead: killed
    max_attempts: int = 3  # a request whose engine died under it this many times fails (500)
    temperature: float = 1.0  # of a request that names none (the Messages API's default); 0: greedy
    engine: str = "ferry"  # a name in ENGINES

    def __post_init__(self) -> None:
        _require(bool(self.model) != bool(self.simulated), "model", "a model (or simulated), not both",
                 self.model or self.simulated or "neither")
        if self.simulated:
            _require(self.simulated in SIMULATED, "simulated", f"one of {list(SIMULATED)}", self.simulated)
        elif self.model not in CONVERTED:
            path = os.path.expanduser(self.model)
            _require(os.path.isfile(os.path.join(path, "config.json")), "model",
                     f"one of {list(CONVERTED)} or a Hugging Face model directory", self.model)
        own = self.model_dir
        if not self.tokenizer:
            object.__setattr__(self, "tokenizer", own or "bytes")
        if not self.chat_template:
            object.__setattr__(self, "chat_template", "model" if own else "labelled")
        super(ContinuousModelConfig, self).__post_init__()
        for name in ("block_size", "max_batch_tokens", "max_seqs"):
            _require(1 <= getattr(self, name) <= 1 << 20, name, "1..1048576", getattr(self, name))
        _require(
            self.max_seqs <= self.max_batch_tokens,
            "max_seqs",
            f"<= max_batch_tokens ({self.max_batch_tokens})",
            self.max_seqs,
        )
        _require(self.num_blocks >= 0, "num_blocks", ">= 0", self.num_blocks)
        _require(0 <= self.kv_memory_gb < math.inf, "kv_memory_gb", "GiB >= 0", self.kv_memory_gb)
        _require(
            not (self.num_blocks and self.kv_memory_gb),
            "kv_memory_gb",
            "num_blocks or kv_memory_gb, not both",
            self.kv_memory_gb,
        )
        _require(self.dtype in DTYPES, "dtype", f"one of {list(DTYPES)}", self.dtype)
        _require(self.device in ("", "cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        _require(1 <= self.threads <= 1024, "threads", "1..1024", self.threads)
        _require(self.affinity_bound >= 0, "affinity_bound", "tokens >= 0", self.affinity_bound)
        _require(
            0 < self.stats_timeout_ms < math.inf,
            "stats_timeout_ms",
            "milliseconds > 0",
            self.stats_timeout_ms,
        )
        _require(0.0 <= self.temperature <= 1.0, "temperature", "a number in 0..1", self.temperature)
        _require(self.engine in ENGINES, "engine", f"one of {list(ENGINES)}", self.engine)
        _require(self.engine == "ferry" or not self.simulated, "engine", "'ferry' for a simulated model",
                 self.engine)
        _require(not self.compile or self.engine == "vllm", "compile", "false unless engine = \"vllm\"",
                 self.compile)
        self.pool()  # checks workers and max_attempts with the pool's own rules

    @property
    def model_dir(self) -> str:
        """The directory the engines load ('' for a simulated engine)."""
        if self.simulated:
            return ""
        return converted_dir(self.model) if self.model in CONVERTED else os.path.expanduser(self.model)

    def _check_files(self) -> None:
        if self.model not in CONVERTED:  # else written at start, checked when the gateway loads them
            super(ContinuousModelConfig, self)._check_files()

    def pool(self) -> PoolConfig:
        """Supervision of the engines: an engine silent for ``stats_timeout_ms`` is hung."""
        return PoolConfig(self.workers, self.stats_timeout_ms / 1000, self.max_attempts, model=self.name)

    def conversion_argv(self) -> list[str] | None:
        """``python -m`` arguments that convert this model into :attr:`model_dir` once (a
        :data:`CONVERTED` name; a later run finds it done in a fraction of a second), or None
        when there is nothing to convert."""
        if self.simulated or self.model not in CONVERTED:
            return None
        return ["workers.convert", self.model, "--out", self.model_dir]

    def engine_argv(self) -> list[str]:
        """``python -m workers`` arguments of one engine worker."""
        if self.simulated:
            argv = ["engine", "--simulated", self.simulated]
            if self.tokenizer == "bytes":
                argv += ["--sim-vocab", "128"]  # ASCII: one character a token
        else:
            kind = "engine" if self.engine == "ferry" else "vllm-engine"
            argv = [kind, "--model", self.model_dir, "--dtype", self.dtype, "--threads", str(self.threads)]
            if self.engine == "vllm":
                argv += ["--max-model-len", str(self.context_window)]
                argv += ["--compile"] if self.compile else []
        argv += ["--block-size", str(self.block_size), "--max-batch-tokens", str(self.max_batch_tokens),
                 "--max-seqs", str(self.max_seqs), "--model-version", self.name]
        if self.num_blocks:
            argv += ["--num-blocks", str(self.num_blocks)]
        elif self.kv_memory_gb:
            argv += ["--kv-memory-gb", str(self.kv_memory_gb)]
        if self.device:
            argv += ["--device", self.device]
        return argv
