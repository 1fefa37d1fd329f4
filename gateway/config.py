"""The server's configuration file: one TOML file describes a whole ferry.

Where it listens, the tiers in priority order, the API keys, the models with their worker fleets
(:mod:`batcher.core.config`), weighted aliases, limits, state, safety and the admin socket.
``load_config(path)`` reads one, ``default_config()`` reads the embedded default that ``ferry
serve`` runs with no file. The gateway's own tables (server, keys, limits, state, safety, admin,
aliases) are defined here; the core's (tiers, models) in :mod:`batcher.core.config` and
:mod:`batcher.core.config_file`, which also converts each table into its frozen dataclass and says
where a bad value came from, so an error reads
``ferry.toml: models[1].max_batch: expected 1..1024, got 0``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from batcher.core.config import ModelConfig, QueueConfig, RayConfig, require
from batcher.core.config_file import TierConfig, build_table, model_table
from gateway import config_env
from gateway.embedded_default import DEFAULT_TOML


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the gateway listens and how it treats connections."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 << 20  # a larger body is answered 413 by aiohttp's own limit
    shutdown_grace_ms: int = 30_000  # SIGTERM: in-flight requests get this long to finish
    ping_interval_ms: int = 5_000  # a stream waiting this long gets a `ping` event
    # Connections (gateway/http/connections.py). The headers of a request are due within
    # header_timeout_ms of the connection's opening or of their first byte (Go servers commonly
    # set 10 s); its body within body_timeout_ms of the headers (4 MiB in 60 s is ~0.6 Mbit/s);
    # a keep-alive connection with nothing to do is closed after idle_timeout_ms (nginx's 75 s,
    # longer than the 60 s a load balancer in front usually keeps an idle connection).
    header_timeout_ms: int = 10_000
    body_timeout_ms: int = 60_000
    idle_timeout_ms: int = 75_000
    max_connections: int = 10_000  # beyond it, the oldest idle connection is closed, else a 503
    access_log_per_second: int = 100  # access log lines a second at most; the rest counted (0: none)

    def __post_init__(self) -> None:
        require(bool(self.host), "host", "an address", self.host)
        require(0 <= self.port <= 65535, "port", "0..65535", self.port)
        require(
            1024 <= self.max_body_bytes <= 1 << 30, "max_body_bytes", "1 KiB..1 GiB", self.max_body_bytes
        )
        require(
            self.shutdown_grace_ms >= 0, "shutdown_grace_ms", "milliseconds >= 0", self.shutdown_grace_ms
        )
        for name in ("ping_interval_ms", "header_timeout_ms", "body_timeout_ms", "idle_timeout_ms"):
            require(getattr(self, name) > 0, name, "milliseconds > 0", getattr(self, name))
        require(
            1 <= self.max_connections <= 1_000_000, "max_connections", "1..1000000", self.max_connections
        )
        require(self.access_log_per_second >= 0, "access_log_per_second", ">= 0", self.access_log_per_second)


MAX_WEIGHT = 1000.0
"""The largest tenant weight: a tenant of weight 1 still gets a thousandth of a busy tier."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeyConfig:
    """An API key (or only its sha256, so the file need not hold the secret) and who holds it."""

    tenant: str
    tier: str
    key: str | None = None
    key_sha256: str | None = None
    tokens_per_minute: int | None = None  # per-key limits, charged at admission (docs/admission.md)
    requests_per_minute: int | None = None
    weight: float = 1.0  # its tenant's share of its tier beside the tier's other tenants (docs/admission.md)

    def __post_init__(self) -> None:
        require((self.key is None) != (self.key_sha256 is None), "key", "exactly one of key, key_sha256",
                 self.key if self.key is not None else self.key_sha256)
        if self.key is not None:
            require(len(self.key) >= 8, "key", "at least 8 characters", "<hidden>")
        if self.key_sha256 is not None:
            digest = self.key_sha256
            require(len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
                     "key_sha256", "64 lowercase hex digits", digest)
        require(bool(self.tenant), "tenant", "a tenant name", self.tenant)
        for name in ("tokens_per_minute", "requests_per_minute"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "> 0", value)
        require(0 < self.weight <= MAX_WEIGHT, "weight", f"a weight in (0, {MAX_WEIGHT}]", self.weight)

    @property
    def digest(self) -> str:
        """The key's sha256 in hex: what the gateway compares a presented key against."""
        if self.key_sha256 is not None:
            return self.key_sha256
        assert self.key is not None, "exactly one of key, key_sha256"
        return hashlib.sha256(self.key.encode()).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Where per-key limits live: ``memory`` (one gateway) or ``redis`` (shared by gateways)."""

    store: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    lease_share: float = 0.0  # > 0: each gateway serves a hot key from this share of its budget
    redis_timeout_ms: int = 100  # a Redis call not answered within it: local buckets until Redis is back

    def __post_init__(self) -> None:
        require(self.store in ("memory", "redis"), "store", "'memory' or 'redis'", self.store)
        require(0.0 <= self.lease_share <= 1.0, "lease_share", "a share in 0..1", self.lease_share)
        require(
            1 <= self.redis_timeout_ms <= 10_000,
            "redis_timeout_ms",
            "1..10000 milliseconds",
            self.redis_timeout_ms,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StateConfig:
    """Where the gateway keeps what must outlive it: usage records and idempotent answers."""

    dir: str = "~/.local/state/ferry"
    idempotency_ttl_s: int = 86_400  # an idempotent answer is replayed this long (24 h)
    idempotency_max_entries: int = 1_000_000  # answers kept at most; past it the oldest go first

    def __post_init__(self) -> None:
        require(self.idempotency_ttl_s >= 1, "idempotency_ttl_s", "seconds >= 1", self.idempotency_ttl_s)
        require(
            self.idempotency_max_entries >= 1, "idempotency_max_entries", ">= 1", self.idempotency_max_entries
        )

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


@dataclasses.dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of requests (docs/operations.md): the ``otel`` extra exports them
    over OTLP/HTTP to ``otlp_endpoint`` (empty: where ``OTEL_EXPORTER_OTLP_ENDPOINT`` says)."""

    enabled: bool = False
    service_name: str = "ferry"
    otlp_endpoint: str = ""


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
            require(len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
                     "token_sha256", "64 lowercase hex digits", digest)


@dataclasses.dataclass(frozen=True, slots=True)
class AliasConfig:
    """A name that spreads its requests over model versions by weight (a rollout's canary): each
    client stays on one version (the gateway splits by a stable hash of its session)."""

    name: str
    weights: tuple[tuple[str, float], ...]  # (version, weight); shares are weight / sum

    def __post_init__(self) -> None:
        require(len(self.weights) >= 1, self.name, "a table of model versions to weights", {})
        for version, weight in self.weights:
            ok = isinstance(weight, int | float) and not isinstance(weight, bool) and 0 <= weight < math.inf
            require(ok, f"{self.name}.{version}", "a weight >= 0", weight)
        require(sum(w for _, w in self.weights) > 0, self.name, "weights adding up to more than 0",
                 dict(self.weights))


@dataclasses.dataclass(frozen=True, slots=True)
class SharedPoolConfig:
    """``[[pools]]``: slots (GPUs) that the model versions naming it (``pool = NAME``) take
    turns on, a version holding one only while it has work (docs/operations.md, "Shared pools")."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "a pool name", self.name)
        require(1 <= self.slots <= 4096, "slots", "1..4096", self.slots)


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
    ray: RayConfig = RayConfig()  # read at start: one process joins one Ray cluster
    tracing: TracingConfig = TracingConfig()  # read at start
    pools: tuple[SharedPoolConfig, ...] = ()

    def __post_init__(self) -> None:
        require(len(self.tiers) >= 1, "tiers", "at least one tier", self.tiers)
        require(len(self.models) >= 1, "models", "at least one model", self.models)
        names = [tier.name for tier in self.tiers]
        for index, key in enumerate(self.keys):
            require(key.tier in names, f"keys[{index}].tier", f"one of {names}", key.tier)
        weights: dict[str, float] = {}
        for index, key in enumerate(self.keys):
            weight = weights.setdefault(key.tenant, key.weight)
            require(key.weight == weight, f"keys[{index}].weight",
                    f"the weight of tenant {key.tenant!r}'s other keys ({weight})", key.weight)
        digests = [key.digest for key in self.keys]
        require(len(set(digests)) == len(digests), "keys", "distinct keys", "a key listed twice")
        seen: dict[str, str] = {}
        for index, model in enumerate(self.models):
            for name in (model.name, *model.aliases):
                if name in seen:
                    raise ValueError(f"models[{index}]: {name!r} already names model {seen[name]!r}")
                seen[name] = model.name
        if any(tier.tpot_target_ms for tier in self.tiers):
            for index, model in enumerate(self.models):
                try:
                    model.check_tpot_targets()
                except ValueError as exc:
                    raise ValueError(f"models[{index}].{exc}") from None
        pools = [pool.name for pool in self.pools]
        require(len(set(pools)) == len(pools), "pools", "distinct pool names", pools)
        for index, model in enumerate(self.models):
            require(not model.pool or model.pool in pools, f"models[{index}].pool",
                    f"a [[pools]] name, one of {pools}", model.pool)
        versions = [model.name for model in self.models]
        for alias in self.aliases:
            require(alias.name not in seen, f"aliases.{alias.name}", "a name no model uses", alias.name)
            for version, _ in alias.weights:
                require(
                    version in versions,
                    f"aliases.{alias.name}",
                    f"model versions, one of {versions}",
                    version,
                )

    def admin_socket(self) -> str:
        """Where the admin interface listens."""
        return os.path.expanduser(self.admin.socket) if self.admin.socket else self.state.path(ADMIN_SOCKET)

    def queue(self) -> QueueConfig:
        """The batchers' queue settings: these tiers, in this priority order, with their budgets,
        and the tenants' weights within a tier (those not 1)."""
        return QueueConfig(
            tiers=tuple(tier.name for tier in self.tiers),
            wait_budgets=tuple(tier.wait_budget_ms / 1000 for tier in self.tiers),
            weights={key.tenant: key.weight for key in self.keys if key.weight != 1.0},
            tpot_targets=tuple(tier.tpot_target_ms / 1000 for tier in self.tiers)
            if any(tier.tpot_target_ms for tier in self.tiers) else None,
        )


_SINGLE = {"server": ServerConfig, "limits": LimitsConfig, "state": StateConfig, "safety": SafetyConfig,
           "admin": AdminConfig, "ray": RayConfig, "tracing": TracingConfig}
_TABLES = {**_SINGLE, "tiers": TierConfig, "keys": KeyConfig, "models": ModelConfig, "aliases": AliasConfig,
           "pools": SharedPoolConfig}


def _aliases(table: object) -> tuple[AliasConfig, ...]:
    """``[aliases]``: ``name = { "version" = weight, ... }`` per alias."""
    require(isinstance(table, dict), "aliases", "a table of aliases", table)
    assert isinstance(table, dict)
    aliases = []
    for name, weights in table.items():
        require(
            isinstance(weights, dict), f"aliases.{name}", "a table of model versions to weights", weights
        )
        try:
            aliases.append(AliasConfig(name, tuple(weights.items())))
        except ValueError as exc:
            raise ValueError(f"aliases.{exc}") from None
    return tuple(aliases)


def _pooled(models: tuple[ModelConfig, ...], pools: tuple[SharedPoolConfig, ...]) -> tuple[ModelConfig, ...]:
    """Each model that names a pool, given that pool's slot count (its scaler's bound)."""
    slots = {pool.name: pool.slots for pool in pools}
    pooled = []
    for index, model in enumerate(models):
        try:
            pooled.append(dataclasses.replace(model, pool_slots=slots[model.pool]) if model.pool in slots
                          else model)
        except ValueError as exc:
            raise ValueError(f"models[{index}].{exc}") from None
    return tuple(pooled)


def parse_config(
    text: str, source: str = "<config>", environ: Mapping[str, str] | None = None, base: str = "."
) -> FerryConfig:
    """A checked :class:`FerryConfig` from TOML text, with ``environ``'s ``FERRY_*`` variables over
    its fields (:mod:`gateway.config_env`); ``ValueError`` names the source and the first field
    that is wrong. Paths a model table reads relative to its file (``pythonpath``) are relative
    to ``base``."""
    config, errors = check_config(text, source, environ, base)
    if config is None:
        raise ValueError(errors[0])
    return config


def check_config(
    text: str, source: str = "<config>", environ: Mapping[str, str] | None = None, base: str = "."
) -> tuple[FerryConfig | None, list[str]]:
    """The configuration, or None and every error found in it (``ferry check-config``): each
    table's, each field of a table that has several (the rest of it checked without the
    field at fault), then, once every table is right, the file's as a whole."""
    try:
        document = tomllib.loads(text)
        placed = config_env.apply(document, environ or {})
    except tomllib.TOMLDecodeError as exc:
        return None, [f"{source}: not valid TOML: {exc}"]
    except ValueError as exc:
        return None, [f"{source}: {exc}"]
    errors: list[str] = []
    unknown = sorted(set(document) - set(_TABLES))
    if unknown:
        errors.append(f"unknown table {unknown[0]!r}; expected one of {sorted(_TABLES)}")
    single: dict[str, Any] = {
        name: _every_error(functools.partial(build_table, cls), document.get(name, {}), name, errors)
        for name, cls in _SINGLE.items()
    }
    lists: dict[str, Any] = {}
    for name in ("tiers", "keys", "models", "pools"):
        tables = document.get(name, [])
        if not isinstance(tables, list):
            errors.append(f"{name}: expected an array of tables ([[...]]), got {tables!r}")
            continue
        build = (functools.partial(model_table, base=base) if name == "models"
                 else functools.partial(build_table, _TABLES[name]))
        lists[name] = tuple(_every_error(build, t, f"{name}[{i}]", errors) for i, t in enumerate(tables))
    try:
        aliases = _aliases(document.get("aliases", {}))
    except ValueError as exc:
        errors.append(str(exc))
    if not errors:
        try:
            lists["models"] = _pooled(lists["models"], lists["pools"])
            return FerryConfig(**single, **lists, aliases=aliases), []
        except ValueError as exc:
            errors.append(str(exc))
    return None, [f"{source}: {error}{_set_by(error, placed)}" for error in errors]


def _every_error(build, table: object, where: str, errors: list[str]) -> object:
    """The table built, or None with each of its errors noted: the field at fault is dropped and
    the rest built again, until the table builds or an error names no field it can drop."""
    dropped: set[str | None] = set()
    while True:
        try:
            return build(table, where)
        except ValueError as exc:
            field = _culprit(str(exc), where)
            if field in dropped:  # its absence, not a mistake of the file's
                return None
            errors.append(str(exc))
            if not isinstance(table, dict) or field not in table:
                return None
            dropped.add(field)
            table = {name: value for name, value in table.items() if name != field}


def _culprit(error: str, where: str) -> str | None:
    """The field of the table at ``where`` that ``error`` is about."""
    if unknown := re.search(r"unknown field '([^']+)'", error):
        return unknown[1]
    named = re.match(re.escape(where) + r"\.(\w+)", error)
    return named[1] if named else None


def _set_by(error: str, placed: Mapping[str, str]) -> str:
    """`` (set by FERRY_...)`` where a variable set the field an error is about."""
    names = [name for name, where in placed.items() if error.startswith(where)]
    return f" (set by {names[0]})" if names else ""


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> FerryConfig:
    """Read and check a configuration file, with ``environ``'s ``FERRY_*`` variables over it."""
    with open(path, encoding="utf-8") as file:
        return parse_config(file.read(), os.fspath(path), environ, os.path.dirname(os.path.abspath(path)))


SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory holding ferry's packages: in a checkout, the repository (its ``examples/``)."""


def default_config(environ: Mapping[str, str] | None = None) -> FerryConfig:
    """The embedded default (:data:`DEFAULT_TOML`): what ``ferry serve`` runs with no file; its
    paths are relative to the repository (:data:`SOURCE_ROOT`)."""
    return parse_config(DEFAULT_TOML, "<embedded default>", environ, SOURCE_ROOT)
