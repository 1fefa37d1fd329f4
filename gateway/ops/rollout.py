"""Live reconfiguration: reload the file, open and drain model versions, shift alias weights.

A new version loads and warms up before it takes any traffic; an old one drains what it has
before its workers stop (docs/operations.md). On the asyncio thread, beside the handlers::

    reload:  re-read the file ─> check it (start-up's messages; plus what cannot change live)
             ─> prepare the new versions in the core (a conversion, once)
             ─> keys, limits, tiers' budgets, safety: at once
             ─> open the new versions in the core (workers ready) ─> swap the routing table
             ─> versions the file dropped: out of routing, drain, then close (workers stop)
    weights: a new split for one alias, swapped in at once (a rollback is this)
    drain:   one version out of routing, drained, closed; the file still lists it

A version takes traffic only once it is in the :class:`~gateway.ops.models.Catalog`, and it enters
the catalog only after its backend has opened with every worker ready. A version leaves the
catalog first, so no new request resolves to it; it is closed only once :class:`Pins` says no
request that resolved to it is still running (whole or streamed, however long), or after
``shutdown_grace_ms``, when whatever is left ends with a retryable error. Nothing is dropped or
answered twice: each request resolves once, to one version, which stays open until it ends.

A reload is all or nothing for models and aliases: if a new version fails to start, the ones
that started are closed again and routing stays as it was (keys, limits, budgets and safety,
already applied, stay). A file that fails its checks changes nothing. Weights set with ``ferry
weights`` hold until a later reload completes (the last instruction wins); a reload that began
before them leaves them be.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from batcher.core.config import ModelConfig
from gateway.bridge import Bridge
from gateway.config import FerryConfig
from gateway.metrics import Metrics
from gateway.ops.models import Catalog, ServedModel, served_model, splits_of
from gateway.ops.pins import Pins
from gateway.ops.routing import Split

log = logging.getLogger("ferry.rollout")

FIXED_SECTIONS = ("server", "limits", "state", "admin")  # what a reload cannot change: restart for these


class VersionState(enum.Enum):
    STARTING = "starting"  # its workers are starting; no traffic
    SERVING = "serving"  # in the routing table
    DRAINING = "draining"  # out of routing; requests that resolved to it are finishing
    STOPPING = "stopping"  # its workers are being stopped
    STOPPED = "stopped"  # drained with `ferry drain`; the file still lists it (a reload restarts it)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What a reload does to the running versions."""

    open: tuple[ModelConfig, ...]  # start these (new, or stopped ones the file lists again)
    revive: tuple[str, ...]  # draining ones the file lists again: back into service
    drain: tuple[str, ...]  # serving ones the file no longer lists


def plan(
    running: FerryConfig, new: FerryConfig, versions: Mapping[str, tuple[ModelConfig, VersionState]]
) -> Plan:
    """The changes from the running state to a new file; ``ValueError`` for what cannot change
    while ferry runs (the listening address, the stores, the tiers' names and order, the
    settings of a version that runs: a new setting is a new version)."""
    for section in FIXED_SECTIONS:
        before, after = getattr(running, section), getattr(new, section)
        if before != after:
            fields = [
                f.name
                for f in dataclasses.fields(before)
                if getattr(before, f.name) != getattr(after, f.name)
            ]
            raise ValueError(f"{section}.{fields[0]}: cannot change while ferry serve runs "
                             f"({getattr(before, fields[0])!r} -> {getattr(after, fields[0])!r}); restart it")
    tiers, new_tiers = [t.name for t in running.tiers], [t.name for t in new.tiers]
    if tiers != new_tiers:
        raise ValueError(
            f"tiers: names and order cannot change while ferry serve runs ({tiers} -> {new_tiers}); "
            "their wait budgets can"
        )
    opened, revived = [], []
    for index, model in enumerate(new.models):
        config, state = versions.get(model.name, (None, None))
        if config is not None and _settings(config) != _settings(model):
            changed = [
                f.name
                for f in dataclasses.fields(model)
                if getattr(config, f.name, None) != getattr(model, f.name) and f.name != "aliases"
            ]
            raise ValueError(
                f"models[{index}]: {model.name!r} is running with other settings ({', '.join(changed)}); "
                "a version's settings cannot change: give the new ones a new version name"
            )
        if state is None or state in (VersionState.STOPPED, VersionState.STOPPING):
            opened.append(model)
        elif state is VersionState.DRAINING:
            revived.append(model.name)
    listed = {model.name for model in new.models}
    drained = tuple(
        name for name, (_, state) in versions.items() if state is VersionState.SERVING and name not in listed
    )
    return Plan(tuple(opened), tuple(revived), drained)


def _settings(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, aliases=())


def leaves(error: BaseException) -> str:
    """The messages at the bottom of an exception group, joined: what actually went wrong."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(leaves(inner) for inner in error.exceptions)
    return f"{type(error).__name__}: {error}"


class ReloadFailed(Exception):
    """A checked file whose new versions did not start: models and aliases are unchanged."""


@dataclasses.dataclass(slots=True)
class Version:
    served: ServedModel
    state: VersionState
    drain: asyncio.Task[None] | None = None


class Served(Protocol):
    """What a rollout reads and changes of the gateway beside it, and nothing more: the applied
    file (``apply`` puts its keys, limits and safety in force), the catalog that routes, the
    bridge to the core, the metrics that track each open version, the requests in flight."""

    config: FerryConfig
    catalog: Catalog
    bridge: Bridge
    metrics: Metrics
    pins: Pins

    def apply(self, config: FerryConfig) -> None: ...


class Rollout:
    """The running versions and the routing over them; every change passes through here."""

    def __init__(self, gateway: Served, reread: Callable[[], FerryConfig], source: str) -> None:
        self.gateway = gateway
        self.reread = reread  # the file again, checked as at start-up
        self.source = source
        self.applied = gateway.config  # the file whose models and aliases run
        serving = VersionState.SERVING
        self.versions = {served.name: Version(served, serving) for served in gateway.catalog.models}
        self.overrides: dict[str, tuple[Split, float]] = {}  # alias -> (split set by `ferry weights`, when)
        self.last_reload: dict[str, Any] = {}
        self._lock = asyncio.Lock()  # one reload or drain at a time; weights never wait for it

    # --- reload ----------------------------------------------------------------------------

    async def reload(self) -> str:
        """Re-read the file and apply it; ``ValueError`` (nothing changed) or ``ReloadFailed``."""
        try:
            summary = await self._reload()
        except Exception as exc:
            self.last_reload = {"at": time.time(), "ok": False, "message": str(exc)}
            raise
        self.last_reload = {"at": time.time(), "ok": True, "message": summary}
        return summary

    async def _reload(self) -> str:
        try:
            new = self.reread()
        except OSError as exc:
            raise ValueError(f"{self.source}: {exc.strerror or exc}") from None
        async with self._lock:
            begun = time.monotonic()
            try:
                changes = plan(
                    self.applied, new, {n: (v.served.config, v.state) for n, v in self.versions.items()}
                )
                index = {model.name: i for i, model in enumerate(new.models)}
                for model in changes.open:  # before its tokenizer is read: preparing may write it
                    await self._prepare(model, f"models[{index[model.name]}]")
                served = [served_model(model, f"models[{index[model.name]}]") for model in changes.open]
            except ValueError as exc:
                raise ValueError(
                    exc if str(exc).startswith(self.source) else f"{self.source}: {exc}"
                ) from None
            await self._apply_settings(new)
            await self._open(served, new)
            for name in changes.revive:
                self._revive(name)
            self.applied = new
            self.overrides = {alias: held for alias, held in self.overrides.items() if held[1] > begun}
            self._route()
            listed = {model.name for model in new.models}
            stopped = [n for n, v in self.versions.items() if v.state is VersionState.STOPPED]
            for name in [n for n in stopped if n not in listed]:
                del self.versions[name]  # drained with `ferry drain`, and now gone from the file too
            for name in changes.drain:
                self._start_drain(name)
        done = [f"opened {', '.join(s.name for s in served)}" if served else "",
                f"back in service {', '.join(changes.revive)}" if changes.revive else "",
                f"draining {', '.join(changes.drain)}" if changes.drain else ""]
        return f"reloaded {self.source}" + "".join(f"; {part}" for part in done if part)

    async def _prepare(self, model: ModelConfig, where: str) -> None:
        """Prepare a version in the core, exactly as its start would (a continuous model named
        by its source is converted once, its progress on the gateway's output), while the
        event loop serves on. ``ValueError`` naming the table if it fails."""
        try:
            await self.gateway.bridge.prepare(model)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None

    async def _apply_settings(self, new: FerryConfig) -> None:
        """What changes at once: keys and their limits and weights, the tiers' budgets, safety."""
        gateway = self.gateway
        if new.queue() != gateway.config.queue():
            await gateway.bridge.retune(new.queue())
        gateway.apply(new)

    async def _open(self, served: list[ServedModel], new: FerryConfig) -> None:
        """Start every new version at once; if any fails, close the rest and raise."""
        gateway = self.gateway
        before: dict[str, Version | None] = {}
        for model in served:
            stopping = self.versions.get(model.name)
            if stopping is not None and stopping.drain is not None:
                await asyncio.shield(stopping.drain)  # a version the file lists again while its workers stop
            before[model.name] = self.versions.get(model.name)  # a stopped one stays stopped if this fails
            self.versions[model.name] = Version(model, VersionState.STARTING)
            gateway.metrics.track(model.name, new.queue().tiers, model.config.worker_hour_price)
        outcomes = await asyncio.gather(
            *(gateway.bridge.open(model.config) for model in served), return_exceptions=True
        )
        failed = {
            model.name: error
            for model, error in zip(served, outcomes, strict=False)
            if isinstance(error, BaseException)
        }
        for model in served:
            if failed:
                if model.name not in failed:
                    await gateway.bridge.close(model.name)
                gateway.metrics.untrack(model.name)
                previous = before[model.name]
                if previous is None:
                    del self.versions[model.name]
                else:
                    self.versions[model.name] = previous
            else:
                self.versions[model.name].state = VersionState.SERVING
        if failed:
            self.applied = dataclasses.replace(new, models=self.applied.models, aliases=self.applied.aliases)
            why = "; ".join(f"{name} did not start: {leaves(error)}" for name, error in failed.items())
            raise ReloadFailed(f"{self.source}: {why}. Models and aliases are unchanged; keys, limits, "
                               "tiers and safety are applied")

    def _revive(self, name: str) -> None:
        version = self.versions[name]
        if version.drain is not None:
            version.drain.cancel()
        version.state, version.drain = VersionState.SERVING, None

    # --- routing ---------------------------------------------------------------------------

    def _splits(self) -> dict[str, Split]:
        """Every alias's split: the file's, or the one ``ferry weights`` set since."""
        splits = {split.alias: split for split in splits_of(self.applied.models, self.applied.aliases)}
        splits.update({alias: split for alias, (split, _) in self.overrides.items()})
        return splits

    def _route(self) -> None:
        """Swap in the catalog of what serves now."""
        serving = {name for name, version in self.versions.items() if version.state is VersionState.SERVING}
        models = [self.versions[m.name].served for m in self.applied.models if m.name in serving]
        splits = [live for split in self._splits().values() if (live := split.among(serving)) is not None]
        self.gateway.catalog = Catalog(models, splits)

    def set_weights(self, alias: str, weights: Mapping[str, float]) -> str:
        """A new split for an alias, in effect for the next request (no lock: a rollback never
        waits behind a reload). Versions left out get no traffic; each named must be serving."""
        if alias not in self._splits():
            raise LookupError(
                f"alias {alias!r} is not configured; aliases: {', '.join(sorted(self._splits()))}"
            )
        for version in weights:
            state = self.versions[version].state.value if version in self.versions else "not a version here"
            if state != VersionState.SERVING.value:
                raise ValueError(f"{version}: cannot take traffic ({state})")
        split = Split(alias, tuple(weights.items()))
        self.overrides[alias] = (split, time.monotonic())
        self._route()
        shares = ", ".join(f"{version} {share:.1%}" for version, share in split.shares.items())
        return f"{alias}: {shares}"

    # --- drain -----------------------------------------------------------------------------

    async def drain(self, name: str) -> str:
        """Take one version out of service, wait for it to drain, stop its workers."""
        async with self._lock:
            version = self.versions.get(name)
            if version is None or version.state is not VersionState.SERVING:
                state = version.state.value if version is not None else "not a version here"
                raise LookupError(f"{name}: not serving ({state})")
            serving = {n for n, v in self.versions.items() if v.state is VersionState.SERVING and n != name}
            for alias, split in self._splits().items():
                if name in split.shares and split.among(serving) is None:
                    raise ValueError(f"{name}: the last version with weight in alias {alias!r}; "
                                     "shift its weight to another version first")
            task = self._start_drain(name)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            return f"{name}: back in service (a reload listed it again)"
        return f"{name}: drained, its workers stopped"

    def _start_drain(self, name: str) -> asyncio.Task[None]:
        version = self.versions[name]
        version.state = VersionState.DRAINING
        self._route()
        version.drain = asyncio.ensure_future(self._drain(name))
        return version.drain

    async def _drain(self, name: str) -> None:
        """Wait until no request holds the version (at most the grace), then stop it; forget it
        unless the file still lists it (then it shows as stopped, and a reload restarts it)."""
        gateway, version = self.gateway, self.versions[name]
        grace = gateway.config.server.shutdown_grace_ms / 1000
        try:
            await asyncio.wait_for(gateway.pins.released(name), grace)
        except TimeoutError:
            log.warning("%s: %d requests still running after %.0f s of draining; they end with an error",
                        name, gateway.pins.count(name), grace)
        version.state = VersionState.STOPPING
        await gateway.bridge.close(name)
        gateway.metrics.untrack(name)
        version.state, version.drain = VersionState.STOPPED, None
        if name not in {model.name for model in self.applied.models}:
            del self.versions[name]
        log.info("%s: drained and stopped", name)

    async def aclose(self) -> None:
        """The server is stopping: drains end with it (the core stops every version)."""
        for version in self.versions.values():
            if version.drain is not None:
                version.drain.cancel()

    # --- status ----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Each version's state, workers and requests in flight; each alias's split."""
        snapshots = await self.gateway.bridge.snapshots()
        versions = []
        for name, version in self.versions.items():
            snapshot = snapshots.get(name)
            status = snapshot.status if snapshot is not None else None
            versions.append({
                "name": name, "state": version.state.value, "ready": bool(status and status.ready),
                "reason": status.reason if status is not None else "not open",
                "workers": len(status.workers) if status is not None else 0,
                "workers_up": sum(w.up for w in status.workers) if status is not None else 0,
                "placements": sorted({w.placement for w in status.workers}) if status is not None else [],
                "in_flight": self.gateway.pins.count(name),
                "queued": status.queued if status is not None else None,
                "queued_unit": status.unit if status is not None else None,
                "tenants": dict(status.tenants) if status is not None else {},
                "scaling": status.scaling if status is not None else "",
            })
        file = {split.alias: split for split in splits_of(self.applied.models, self.applied.aliases)}
        routed = self.gateway.catalog.splits
        aliases = [{
            "name": alias, "weights": routed[alias].shares if alias in routed else {},
            "file": file[alias].shares if alias in file else {},
            "set_by": "ferry weights" if alias in self.overrides else "file",
        } for alias, split in self._splits().items()]
        return {
            "config": self.source,
            "versions": versions,
            "aliases": aliases,
            "last_reload": self.last_reload,
        }
