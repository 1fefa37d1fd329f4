"""The scaler's pure core: how many workers a model version should serve with, and why.

It decides from the signals its mode already computes for admission, in the mode's own unit:
the top tier's predicted wait against its budget (up fast: past ``UP_AT`` of the budget), the work
done per second against what one worker clears (the workers that rate needs at ``UTILISATION``),
and free KV blocks. Down is slow: only after ``scale_down_after`` seconds of spare capacity, never
below ``min_workers``; an idle version with ``min_workers = 0`` stops after ``idle_after``.
:func:`plan` turns a decision into steps (promote warm workers first; a leaving worker is one
starting, then idle, and a busy one only drains), :func:`cold_start` judges a request that finds
no worker. Pure: the trio shell is :mod:`batcher.core.scaling`."""

from __future__ import annotations

import dataclasses
import math

from batcher.core.config import ScalerConfig

UP_AT = 0.5
"""Scale up once the top tier's predicted wait passes this fraction of its wait budget."""
UTILISATION = 0.8
"""The share of its capacity a worker is planned to run at: the headroom a burst's first seconds use."""
KV_LOW = 0.1
"""Scale up while fewer than this share of the serving workers' KV blocks are free."""


@dataclasses.dataclass(frozen=True, slots=True)
class Signals:
    """What a backend reports for scaling, in its own unit of work (requests or tokens)."""

    wait: float  # predicted seconds before a worker takes the top tier's next job
    budget: float  # the top tier's wait budget, seconds
    rate: float  # work per second the fleet has been doing lately
    per_worker: float  # work per second one worker clears at full speed (0: not measured yet)
    queued: float = 0.0  # work waiting
    busy: int = 0  # workers with work in flight
    free_kv: float = 1.0  # share of the serving workers' KV blocks free (1 where there is no KV cache)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """How many workers should serve, and why: ``direction`` is ``up``, ``down`` or ``hold``;
    ``cause`` a short label for the scale-event counter, ``reason`` the sentence for the log."""

    serving: int
    direction: str
    cause: str
    reason: str


class Scaler:
    """Decides at each tick from the version's signals (see the module doc); remembers only
    since when capacity has been spare, and since when the version has had no work."""

    def __init__(self, config: ScalerConfig) -> None:
        self.config = config
        self._spare_since = math.inf
        self._idle_since = math.inf

    def needed(self, signals: Signals) -> int:
        """Workers the recent rate of work needs at ``UTILISATION`` (0 for no work at all)."""
        if signals.per_worker <= 0:
            return 0
        return math.ceil(signals.rate / (signals.per_worker * UTILISATION) - 1e-9)

    def decide(self, signals: Signals, serving: int, now: float, starting: int = 0) -> Decision:
        """The workers to serve with at ``now``, given those serving or starting to (``serving``),
        ``starting`` of them not ready yet: a start under way is work asked for, not idleness."""
        low, high = self.config.min_workers, self.config.max_workers
        working = signals.queued > 0 or signals.busy > 0 or starting > 0
        self._idle_since = math.inf if working else min(self._idle_since, now)
        needed = max(self.needed(signals), 1 if working else 0)
        if serving == 0 and working:
            return self._to(max(1, low, needed), serving, "up", "cold", "work arrived with no worker")
        if serving == 0 and not low:  # the rate of work decays for ever: only work starts a worker
            return Decision(serving, "hold", "", "")
        if signals.wait > UP_AT * signals.budget and serving < high:
            self._spare_since = math.inf
            reason = (f"top tier's predicted wait {signals.wait:.3f}s is over {UP_AT:.0%} of its "
                      f"{signals.budget:g}s budget")
            return self._to(max(needed, serving + 1), serving, "up", "wait", reason)
        if signals.free_kv < KV_LOW and serving < high:
            self._spare_since = math.inf
            return self._to(serving + 1, serving, "up", "kv", f"{signals.free_kv:.0%} of KV blocks free")
        if needed > serving:
            self._spare_since = math.inf
            reason = f"{signals.rate:.3g}/s of work needs {needed} workers at {UTILISATION:.0%}"
            return self._to(needed, serving, "up", "demand", reason)
        if serving < low:
            return self._to(low, serving, "up", "min", f"fewer than min_workers = {low}")
        if not working and not low and serving and now - self._idle_since >= self.config.idle_after:
            return self._to(0, serving, "down", "idle", f"no work for {self.config.idle_after:g}s")
        floor = max(low, needed, 1 if serving else 0)  # only idleness stops the last worker
        if floor >= serving:
            self._spare_since = math.inf
            return Decision(serving, "hold", "", "")
        self._spare_since = min(self._spare_since, now)
        if now - self._spare_since < self.config.scale_down_after:
            return Decision(serving, "hold", "", "")
        self._spare_since = now  # the next step down waits a whole delay again
        reason = f"spare capacity for {self.config.scale_down_after:g}s: {signals.rate:.3g}/s needs {floor}"
        return self._to(floor, serving, "down", "spare", reason)

    def _to(self, target: int, serving: int, direction: str, cause: str, reason: str) -> Decision:
        target = min(self.config.max_workers, max(self.config.min_workers, target))
        if target == serving:
            return Decision(serving, "hold", "", "")
        return Decision(target, direction, cause, reason)


@dataclasses.dataclass(frozen=True, slots=True)
class Fleet:
    """A version's workers by role: ``serving`` and ``starting`` (to serve), ``warm`` (ready, no
    traffic), ``warming`` (starting to be warm), ``idle`` (serving with nothing in flight)."""

    serving: int
    starting: int = 0
    warm: int = 0
    warming: int = 0
    idle: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Steps:
    """What the shell does to reach a decision: warm workers to promote, workers to start (to
    serve, and to warm), and serving workers to take away (starting ones first, then idle ones;
    busy ones among them drain before they stop)."""

    promote: int = 0
    start: int = 0
    start_warm: int = 0
    retire: int = 0


def plan(target: int, fleet: Fleet, warm_workers: int) -> Steps:
    """The steps from ``fleet`` to ``target`` serving workers with ``warm_workers`` kept warm:
    a ready warm worker is promoted before any is started, and in place of one still starting
    (which then leaves: starting ones leave first), and the warm pool is refilled after."""
    promote = min(max(0, target - fleet.serving), fleet.warm)
    heading = fleet.serving + promote + fleet.starting
    refill = max(0, warm_workers - (fleet.warm - promote) - fleet.warming)
    return Steps(promote, max(0, target - heading), refill, max(0, heading - target))


def leaving(states: list[tuple[int, str]], count: int) -> list[int]:
    """Which ``count`` of these (slot, state) workers leave: starting ones first, then idle ones,
    then busy ones (which drain); the highest slot first within each, as the lowest idle slot
    takes the next work."""
    rank = {"starting": 0, "idle": 1}
    order = sorted(states, key=lambda item: (rank.get(item[1], 2), -item[0]))
    return [slot for slot, _ in order[:count]]


@dataclasses.dataclass(frozen=True, slots=True)
class ColdStart:
    """The verdict on a request that finds no worker serving: wait for one, or come back later."""

    wait: bool
    ready_in: float  # seconds until a worker is expected to be ready


def cold_start(start_time: float, started_for: float, budget: float) -> ColdStart:
    """Whether a request with a wait ``budget`` waits for a worker that takes ``start_time``
    seconds to start (as measured for this version) and has been starting for ``started_for``
    seconds: it waits if the rest of the start fits its budget, else it is told when to return."""
    ready_in = max(0.0, start_time - started_for)
    return ColdStart(ready_in <= budget, ready_in)
