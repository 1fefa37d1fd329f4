"""The rate-limit headers each API's SDKs and dashboards read, from a key's plan and its buckets'
levels after the charge (gateway/accounting/ratelimit.py): pure.

    Anthropic   anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}   reset: RFC 3339
    OpenAI      x-ratelimit-{limit,remaining,reset}-{requests,tokens}           reset: "1.5s", "250ms"

A bucket holds a minute of its plan and refills continuously, so ``remaining`` is its level
(whole units, rounded down) and ``reset`` when it is full again. A dimension without a limit has
no header; levels the store cannot tell (a leased slice) leave only ``limit``."""

from __future__ import annotations

import math
import time

Plan = tuple[int | None, int | None]  # tokens per minute, requests per minute (None: unlimited)
Levels = tuple[float, float] | None
_DIMENSIONS = ("tokens", "requests")


def _buckets(plan: Plan, levels: Levels):
    """(dimension, limit, remaining or None, seconds until full or None) of each limited one."""
    for index, (name, limit) in enumerate(zip(_DIMENSIONS, plan, strict=True)):
        if limit is None:
            continue
        if levels is None:
            yield name, limit, None, None
            continue
        level = max(0.0, min(float(limit), levels[index]))
        yield name, limit, math.floor(level), (limit - level) / (limit / 60.0)


def anthropic(plan: Plan, levels: Levels, now: float | None = None) -> dict[str, str]:
    """Anthropic's headers; ``now`` (Unix seconds) dates the resets."""
    now = time.time() if now is None else now
    headers = {}
    for name, limit, remaining, seconds in _buckets(plan, levels):
        headers[f"anthropic-ratelimit-{name}-limit"] = str(limit)
        if remaining is not None and seconds is not None:
            headers[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
            full = time.gmtime(math.ceil(now + seconds))
            headers[f"anthropic-ratelimit-{name}-reset"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", full)
    return headers


def openai(plan: Plan, levels: Levels, now: float | None = None) -> dict[str, str]:
    """OpenAI's headers (``now`` unused: its resets are durations)."""
    headers = {}
    for name, limit, remaining, seconds in _buckets(plan, levels):
        headers[f"x-ratelimit-limit-{name}"] = str(limit)
        if remaining is not None and seconds is not None:
            headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
            headers[f"x-ratelimit-reset-{name}"] = _duration(seconds)
    return headers


def _duration(seconds: float) -> str:
    """A wait as OpenAI writes it: ``250ms`` under a second, else ``1.5s`` (never a minute or
    more: a bucket is full within one)."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    return f"{math.ceil(seconds * 1000) / 1000:g}s"
