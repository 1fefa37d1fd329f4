"""Every answer of a chaos run, judged: pure, so the rules are tested without a gateway.

A scenario documents which statuses its fault may cause (:class:`Rules`); everything else a
client could notice is a violation: a malformed body, a 529 without ``Retry-After``, an error
that names a pid or carries a traceback, another request's text, a stream that ends neither
with ``message_stop`` nor with an ``error`` event, and a usage record that is missing, twice
there, or disagrees with the status the client got or with the tokens it received (every row's
model counts a token as a UTF-8 byte, so the text received says how many were delivered).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import re
from collections.abc import Callable, Iterable

import numpy as np

from experiments.chaos.traffic import Shot
from gateway.accounting.usage import UsageRecord

STREAM_OPEN = ["message_start", "content_block_start"]
STREAM_CLOSE = ["content_block_stop", "message_delta", "message_stop"]
LEAKY = re.compile(r"\bpid\b|Traceback|File \"")
STATUS_OF = {"invalid_request_error": 400, "rate_limit_error": 429, "api_error": 500, "overloaded_error": 529}
"""The status each API error type stands for: a stream that fails after its headers carries the
type in its ``error`` event, and it is documented exactly when that status is."""


def mirror(shot: Shot) -> str:
    """What a reference (``sleep``) worker answers: the labelled prompt, reversed."""
    return f"User: {shot.text}"[::-1]


@dataclasses.dataclass(frozen=True, slots=True)
class Rules:
    """What a scenario documents: the error statuses its fault may cause (beside 200, whether
    answered as a status or, in a stream already open, as an ``error`` event), which requests
    may get which (``allowed(shot)``: None for the scenario's own set), and the answer each 200
    must carry (None: no content check)."""

    statuses: frozenset[int] = frozenset({529})
    expected: Callable[[Shot], str] | None = mirror
    allowed: Callable[[Shot], frozenset[int] | None] = lambda shot: None
    closed_after: float | None = None  # loop time the gateway began to shut down: a request it had
    # not read by then may be refused or have its connection closed (a usage record shows any it had)
    answer_within: Callable[[Shot], float] | None = None  # the latest any answer may come, per request
    cut_streams: bool = False  # the gateway is killed at closed_after: a stream still open is cut short
    stream_errors: bool = True  # a stream answered 200 may end with a documented error event


@dataclasses.dataclass(slots=True)
class Verdict:
    name: str
    sent: int = 0
    succeeded: int = 0
    documented: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    gave_up: int = 0
    lost: int = 0
    duplicated: int = 0
    p99_ms: float = float("nan")
    recovery_s: float | None = None
    violations: list[str] = dataclasses.field(default_factory=list)
    resources: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations and self.lost == 0 and self.duplicated == 0

    def violate(self, message: str) -> None:
        if len(self.violations) < 20:  # the first few say it; the count says how many
            self.violations.append(message)


def judge(name: str, shots: list[Shot], usage: Iterable[UsageRecord], rules: Rules,
          fault_times: Iterable[float] = (), problems: Iterable[str] = ()) -> Verdict:
    """The verdict on one run (see the module doc)."""
    verdict = Verdict(name, sent=len(shots))
    for problem in problems:
        verdict.violate(problem)
    records = collections.defaultdict(list)
    for record in usage:
        records[record.request_id].append(record)
    verdict.duplicated = sum(len(rows) - 1 for rows in records.values() if len(rows) > 1)
    answered_ids = collections.Counter(s.request_id for s in shots if s.request_id)
    verdict.duplicated += sum(count - 1 for count in answered_ids.values() if count > 1)
    for shot in shots:
        if shot.give_up:
            verdict.gave_up += 1
            continue
        if shot.status is None:
            closing = rules.closed_after is not None and (shot.finished or 0.0) >= rules.closed_after
            if closing:
                verdict.documented["not read before shutdown"] += 1
            else:
                verdict.lost += 1
                verdict.violate(f"request {shot.index} got no answer ({shot.failure})")
            continue
        if rules.cut_streams and _cut(shot, rules):
            verdict.documented["stream cut by the kill"] += 1  # not answered: neither billed nor owed
            continue
        _judge_answer(shot, rules, verdict)
        _judge_usage(shot, records.get(shot.request_id or "", []), verdict)
        if (
            rules.answer_within is not None
            and shot.latency is not None
            and shot.latency > rules.answer_within(shot)
        ):
            rows = records.get(shot.request_id or "", [])
            own = f" (the gateway's own timing: {rows[0].total_s:.2f} s)" if rows else ""
            verdict.violate(f"request {shot.index} ({shot.tier}) answered after {shot.latency:.2f} s{own}, "
                            f"not within {rules.answer_within(shot):.2f} s")
    received = {s.request_id for s in shots if s.request_id}
    for request_id, rows in records.items():
        if request_id not in received and rows[0].status != 499:
            verdict.violate(f"usage record {request_id} ({rows[0].status}, {rows[0].outcome}): "
                            "no client received that answer")
    latencies = [s.latency for s in shots if s.succeeded and s.latency is not None]
    verdict.p99_ms = float(np.percentile(latencies, 99) * 1000) if latencies else float("nan")
    verdict.recovery_s = recovery(shots, fault_times)
    return verdict


def _cut(shot: Shot, rules: Rules) -> bool:
    """A stream open when the gateway was killed, that never got its closing events."""
    names = [name for name, _ in shot.events if name != "ping"]
    ended = names[-1:] == ["error"] or names[-3:] == STREAM_CLOSE
    return shot.stream and not ended and (shot.finished or 0.0) >= (rules.closed_after or 0.0)


def _judge_answer(shot: Shot, rules: Rules, verdict: Verdict) -> None:
    allowed = rules.allowed(shot)
    statuses = rules.statuses if allowed is None else allowed
    where = f"request {shot.index} ({'stream' if shot.stream else 'whole'}, {shot.tier})"
    if shot.status != 200:
        if shot.status not in statuses:
            verdict.violate(f"{where}: status {shot.status} is not documented here: {shot.body}")
            return
        error = (shot.body or {}).get("error", {})
        if (shot.body or {}).get("type") != "error" or not error.get("type") or not error.get("message"):
            verdict.violate(f"{where}: a {shot.status} without the error body: {shot.body}")
        elif LEAKY.search(error["message"]):
            verdict.violate(f"{where}: an error message names internals: {error['message']!r}")
        if shot.status in (429, 529) and not shot.retry_after:
            verdict.violate(f"{where}: a {shot.status} without Retry-After")
        verdict.documented[str(shot.status)] += 1
        return
    if shot.stream:
        names = [name for name, _ in shot.events if name != "ping"]
        if names[-1:] == ["error"]:
            error = shot.events[-1][1].get("error", {})
            status = STATUS_OF.get(error.get("type"))
            if not rules.stream_errors:
                verdict.violate(f"{where}: a stream ended with an error event where streams survive: {error}")
            elif status not in statuses or LEAKY.search(error.get("message", "")):
                verdict.violate(f"{where}: a stream ended with an undocumented error event: {error}")
            else:
                verdict.documented[f"{status} in stream"] += 1
            return
        if names[:1] != ["message_start"] or names[-3:] != STREAM_CLOSE:
            verdict.violate(f"{where}: a stream out of order: {names}")
            return
    elif shot.output is None:
        verdict.violate(f"{where}: a 200 without a message body: {shot.body}")
        return
    if rules.expected is not None and shot.output != rules.expected(shot):
        verdict.violate(f"{where}: answered {shot.output[:60]!r}, not its own input's answer")
        return
    shot.succeeded = True
    verdict.succeeded += 1


def _judge_usage(shot: Shot, rows: list[UsageRecord], verdict: Verdict) -> None:
    if shot.request_id is None:
        if shot.status in (200, 429, 500, 529):
            verdict.violate(f"request {shot.index}: a {shot.status} without a request-id")
        return
    if not rows:
        verdict.violate(f"request {shot.index}: no usage record for {shot.request_id}")
    elif rows[0].status != shot.status:
        verdict.violate(f"request {shot.index}: usage says {rows[0].status}, the client got {shot.status}")
    elif rows[0].output_tokens != len((shot.output or "").encode()):
        # every row's model counts tokens as UTF-8 bytes (the bytes tokenizer, ASCII engines)
        verdict.violate(f"request {shot.index}: billed {rows[0].output_tokens} output tokens, "
                        f"received {len((shot.output or '').encode())}")


def recovery(shots: list[Shot], fault_times: Iterable[float]) -> float | None:
    """The longest time from a fault to the arrival of the first request after it that
    succeeded: how long the fleet took to serve again (None: no fault, or never)."""
    served = sorted(s.scheduled for s in shots if s.status == 200 and not s.give_up and s.output is not None)
    worst = None
    for fault in fault_times:
        at = bisect.bisect_left(served, fault)
        if at < len(served):
            worst = max(worst or 0.0, served[at] - fault)
    return worst
