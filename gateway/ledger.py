"""The ledger: what a request is charged at admission, and what it is billed and counted at the end.

Seed 000 §6.7 and §6.3, DESIGN §8-9. Per request, in the gateway's asyncio thread:

    charge(...) charge input_tokens + max_tokens to the key's limit, all or nothing
                  over the limit  -> RateLimited (429, Retry-After when it would fit)
                  can never fit   -> InvalidRequest (400: bigger than a minute of the plan)
    ... the request runs; the handler notes the first token and what it delivered ...
    close(...)  refund what was not used, write one usage record, observe the metrics

Only tokens actually delivered are billed and kept charged: an answer cut short refunds its
unused ``max_tokens``, and a request that never reached a model (shed 529, failed) refunds its
input tokens too. The usage record and the metrics name the key by ``key_id`` and the model
by version; no key and no prompt text leave this module.
"""

from __future__ import annotations

import dataclasses
import time

from batcher.metrics import Metrics
from gateway.api import InvalidRequest, RateLimited
from gateway.limiter import Limiter
from gateway.ratelimit import Limits
from gateway.usage import UsageLog, UsageRecord


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
    stop_reason: str | None = None

    def delivered(self, tokens: int, now: float | None = None) -> None:
        """Note output tokens sent to the client (the first call marks the first token)."""
        if tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic() if now is None else now
        self.output_tokens += tokens


class Ledger:
    def __init__(self, limiter: Limiter, usage: UsageLog, metrics: Metrics) -> None:
        self.limiter = limiter
        self.usage = usage
        self.metrics = metrics
        self._series: dict[tuple[str, str, int], tuple] = {}

    async def charge(self, entry: Entry) -> None:
        """Charge the request's worst case to its key, or raise the 429 / 400 that says why not."""
        if entry.limits.unlimited:  # the common case of an internal key: no store to ask
            return
        cost = entry.input_tokens + entry.max_tokens
        verdict = await self.limiter.acquire(entry.key_id, entry.limits, cost)
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

    async def close(self, entry: Entry) -> None:
        """Refund the unused part, record usage, observe the request's metrics; call once."""
        now, status = time.monotonic(), entry.status
        if entry.charged:
            unused = entry.max_tokens - min(entry.output_tokens, entry.max_tokens)
            if entry.first_token_at is None and status != 200:
                unused += entry.input_tokens  # it never reached a model
            if unused:
                await self.limiter.refund(entry.key_id, entry.limits, unused)
        total = now - entry.started
        ttft = None if entry.first_token_at is None else entry.first_token_at - entry.started
        self.usage.record(UsageRecord(
            entry.request_id, time.time(), entry.tenant, entry.key_id, entry.model, entry.input_tokens,
            entry.output_tokens, ttft, total, status, entry.stop_reason,
        ))
        series = self._series.get((entry.model, entry.tier, status))
        if series is None:
            series = self._series[entry.model, entry.tier, status] = self._labelled(entry.model, entry.tier, status)
        requests, latency, first_token, per_token, overloaded = series
        requests.inc()
        latency.observe(total)
        if ttft is not None:
            first_token.observe(ttft)
            if entry.output_tokens > 1:
                per_token.observe((total - ttft) / (entry.output_tokens - 1))
        if overloaded is not None:
            overloaded.inc()

    def _labelled(self, model: str, tier: str, status: int) -> tuple:
        """The metric series one (model, tier, status) writes to: looked up once, not per request."""
        metrics = self.metrics
        return (
            metrics.requests.labels(model, tier, str(status)),
            metrics.latency.labels(model, tier),
            metrics.ttft.labels(model, tier),
            metrics.time_per_output_token.labels(model, tier),
            metrics.admission_rejects.labels(model, tier, "overloaded") if status == 529 else None,
        )
