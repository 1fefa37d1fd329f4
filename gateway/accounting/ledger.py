"""The ledger: what a request is charged at admission, and what it is billed and counted at the end.

Per request (docs/admission.md), in the gateway's asyncio thread::

    charge(...)     input_tokens + max_tokens against the key's limit: 429, or 400 if it can never fit
    ... the request runs; after each write the handler notes the tokens it delivered ...
    bill_ahead(...) just before the answer's last bytes: its usage record, journaled
    close(...)      refund what was not used; correct the record if the last bytes never left

Only tokens actually delivered are billed: an answer cut short refunds its unused ``max_tokens``,
and a request that never reached a model refunds its input too. A record says what happened (its
:class:`Outcome`) beside the HTTP status the client got, and names the key by ``key_id``."""

from __future__ import annotations

import dataclasses
import enum
import time

from batcher.core.errors import Overloaded, Shed
from gateway.accounting.limiter import Limiter
from gateway.accounting.ratelimit import Limits
from gateway.accounting.usage import UsageLog, UsageRecord
from gateway.metrics import Metrics
from gateway.wire.api import InvalidRequest, RateLimited


class Outcome(enum.Enum):
    """What happened to a request, whatever status its client saw."""

    COMPLETED = "completed"  # answered in full
    SHED = "shed"  # 529 at admission: the fleet could not take it within its tier's budget
    EXPIRED = "expired"  # 529: admitted, but not dispatched before its deadline
    RATE_LIMITED = "rate_limited"  # 429: its key's per-minute budget was used up
    FAILED = "failed"  # an error answered before any output was sent
    INTERRUPTED = "interrupted"  # a stream that failed after sending output (its status: 200)
    CANCELLED = "cancelled"  # the client went away before its answer was whole (499)


REJECTED = {Outcome.SHED: "shed", Outcome.EXPIRED: "expired"}  # admission_rejects reasons


def outcome_of(error: BaseException) -> Outcome:
    """The outcome of a request that ended with ``error`` before any output was sent."""
    if isinstance(error, Shed):
        return Outcome.SHED
    if isinstance(error, Overloaded):
        return Outcome.EXPIRED
    if isinstance(error, RateLimited):
        return Outcome.RATE_LIMITED
    return Outcome.FAILED


@dataclasses.dataclass(slots=True)
class Entry:
    """One request's account, from admission to its end."""

    request_id: str
    tenant: str
    key_id: str
    tier: str
    model: str
    limits: Limits
    input_tokens: int
    max_tokens: int
    started: float  # time.monotonic() at arrival
    charged: bool = False
    first_token_at: float | None = None
    output_tokens: int = 0  # delivered to the client
    status: int = 500  # the HTTP status the client got (set as the request ends)
    outcome: Outcome = Outcome.FAILED
    stop_reason: str | None = None
    cached_tokens: int = 0  # of input_tokens, those the prefix cache supplied (known at the end)
    client_request_id: str | None = None  # the client's X-Request-Id, recorded beside ours
    limit_levels: tuple[float, float] | None = None  # the key's buckets after its charge (the headers')
    owed: int = 0  # output tokens in a whole answer not yet written
    # False: an idempotent repeat (replayed or refused) ran nothing, so nothing is recorded
    recorded: bool = True
    billed: UsageRecord | None = None  # the record written ahead of the last bytes, if any

    @property
    def reached_model(self) -> bool:
        """Whether a model read its input (billed), as far as its answer shows."""
        return self.first_token_at is not None or self.status == 200

    def delivered(self, tokens: int, now: float | None = None) -> None:
        """Note output tokens just written to the client (the first write marks the first token)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic() if now is None else now
        self.output_tokens += tokens


class Ledger:
    def __init__(self, limiter: Limiter, usage: UsageLog, metrics: Metrics) -> None:
        self.limiter = limiter
        self.usage = usage
        self.metrics = metrics
        self._series: dict[tuple[str, str, int, Outcome], tuple] = {}
        self._tenant_series: dict[tuple[str, str, Outcome], tuple] = {}

    async def charge(self, entry: Entry) -> None:
        """Charge the request's worst case to its key, or raise the 429 / 400 that says why not."""
        if entry.limits.unlimited:  # the common case of an internal key: no store to ask
            return
        cost = entry.input_tokens + entry.max_tokens
        verdict = await self.limiter.acquire(entry.key_id, entry.limits, cost)
        entry.limit_levels = verdict.levels
        if verdict.admitted:
            entry.charged = True
            return
        self.metrics.admission_rejects.labels(entry.model, entry.tier, "rate_limit").inc()
        if verdict.never:
            raise InvalidRequest(
                f"max_tokens: input_tokens + max_tokens = {cost} is more than this key's "
                f"{entry.limits.tokens_per_minute} tokens per minute"
            )
        raise RateLimited(f"this key's per-minute limit is used up; retry in {verdict.retry_after:.3f}s",
                          verdict.retry_after)

    def bill_ahead(self, entry: Entry, status: int, tokens: int) -> None:
        """Record the request as answered with ``tokens`` more delivered, before the bytes that
        carry them (the answer's last) are written: once they are, the client is billed."""
        if entry.recorded:
            now = time.monotonic()
            first = now if entry.first_token_at is None else entry.first_token_at
            entry.billed = _record(entry, now, status, Outcome.COMPLETED, entry.output_tokens + tokens, first)
            self.usage.record(entry.billed)

    async def close(self, entry: Entry) -> None:
        """Refund the unused part, record usage, observe the request's metrics; call once."""
        now, status = time.monotonic(), entry.status
        if entry.charged:
            unused = entry.max_tokens - min(entry.output_tokens, entry.max_tokens)
            if not entry.reached_model:
                unused += entry.input_tokens
            if unused:
                await self.limiter.refund(entry.key_id, entry.limits, unused)
        total = now - entry.started
        ttft = None if entry.first_token_at is None else entry.first_token_at - entry.started
        billed = entry.billed
        if billed is None or (billed.status, billed.outcome, billed.output_tokens) != (
                status, entry.outcome.value, entry.output_tokens):
            self.usage.record(_record(entry, now), replace=billed is not None)
        key = (entry.model, entry.tier, status, entry.outcome)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._labelled(*key)
        requests, latency, first_token, per_token, rejected = series
        requests.inc()
        latency.observe(total)
        if ttft is not None and entry.output_tokens:
            first_token.observe(ttft)
            if entry.output_tokens > 1:
                per_token.observe((total - ttft) / (entry.output_tokens - 1))
        if rejected is not None:
            rejected.inc()
        self._count_tenant(entry, ttft)

    def _count_tenant(self, entry: Entry, ttft: float | None) -> None:
        """The request in its tenant's families (``other`` for a tenant the config does not name)."""
        key = (entry.model, self.metrics.tenant(entry.tenant), entry.outcome)
        series = self._tenant_series.get(key)
        if series is None:
            model, tenant, outcome = key
            metrics = self.metrics
            series = self._tenant_series[key] = (
                metrics.tenant_requests.labels(model, tenant, outcome.value),
                metrics.tenant_tokens.labels(model, tenant, "input"),
                metrics.tenant_tokens.labels(model, tenant, "output"),
                metrics.tenant_ttft.labels(model, tenant),
            )
        requests, input_tokens, output_tokens, first_token = series
        requests.inc()
        if entry.recorded and entry.reached_model:  # the tokens it is billed
            input_tokens.inc(entry.input_tokens)
            output_tokens.inc(entry.output_tokens)
            self.metrics.count_tokens(entry.model, entry.input_tokens + entry.output_tokens)
        if ttft is not None and entry.output_tokens:
            first_token.observe(ttft)

    def _labelled(self, model: str, tier: str, status: int, outcome: Outcome) -> tuple:
        """The metric series one (model, tier, status, outcome) writes to: looked up once."""
        metrics = self.metrics
        reason = REJECTED.get(outcome)
        return (
            metrics.requests.labels(model, tier, str(status)),
            metrics.latency.labels(model, tier),
            metrics.ttft.labels(model, tier),
            metrics.time_per_output_token.labels(model, tier),
            metrics.admission_rejects.labels(model, tier, reason) if reason else None,
        )


def _record(entry: Entry, now: float, status: int | None = None, outcome: Outcome | None = None,
            output_tokens: int | None = None, first_token_at: float | None = None) -> UsageRecord:
    """The usage record of ``entry`` as it stands at ``now`` (time.monotonic()), or as it will
    once answered with ``status``, ``outcome``, ``output_tokens`` and ``first_token_at`` (each
    given replaces the entry's; no copy of the entry is made, once a request)."""
    first = entry.first_token_at if first_token_at is None else first_token_at
    ttft = None if first is None else first - entry.started
    return UsageRecord(
        entry.request_id, time.time(), entry.tenant, entry.key_id, entry.model, entry.input_tokens,
        entry.output_tokens if output_tokens is None else output_tokens, ttft, now - entry.started,
        entry.status if status is None else status, entry.stop_reason,
        (entry.outcome if outcome is None else outcome).value, entry.cached_tokens, entry.client_request_id,
    )
