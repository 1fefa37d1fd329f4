"""Open-loop arrivals into one engine alone (no pool), with a batching policy, in virtual time.

:func:`drive` feeds requests arriving at given times into a :class:`~experiments.continuous_common.Replica`
and records, per request, when it arrived, its first token and its end (a token exists once the
step that made it has passed). What decides which waiting requests the engine may take is the
``policy``: a function of the replica that says how many may be added now. The engine's own
scheduler (token budget, ``max_seqs``, KV blocks) still decides what runs in each step.

    NONE        one request at a time: the next is added once the engine is empty
    static(n)   up to n waiting requests are added together, and only once the previous batch has
                drained; a sequence that ends leaves, but its place stays empty until then
    CONTINUOUS  every arrival is added at once; the scheduler fills each step with what fits

:func:`sweep` and :func:`highest` are the experiments' capacity search: rising rates replayed until
one fails, and the highest whose replay (and every one below it) meets the targets;
:func:`refine` bisects between that and the first failure.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from experiments.continuous_common import Replica

Policy = Callable[[Replica], float]


def NONE(replica: Replica) -> float:
    return 0 if replica.engine.has_work else 1


def static(size: int) -> Policy:
    def admit(replica: Replica) -> float:
        return 0 if replica.engine.has_work else size

    return admit


def CONTINUOUS(replica: Replica) -> float:
    return math.inf


@dataclasses.dataclass(frozen=True)
class Served:
    """Per request: arrival, first token and end, in virtual seconds; tokens it got."""

    arrived: np.ndarray
    first: np.ndarray
    end: np.ndarray
    tokens: np.ndarray
    seconds: float  # virtual seconds until the last request ended

    @property
    def ttft(self) -> np.ndarray:
        return self.first - self.arrived

    @property
    def tpot(self) -> np.ndarray:
        return np.where(self.tokens > 1, (self.end - self.first) / np.maximum(self.tokens - 1, 1), 0.0)

    def p95(self) -> tuple[float, float]:
        """TTFT and TPOT at p95, seconds."""
        return float(np.percentile(self.ttft, 95)), float(np.percentile(self.tpot, 95))


def drive(
    replica: Replica, times: np.ndarray, prompts: Sequence[int], answers: Sequence[int], policy: Policy
) -> Served:
    """Replay arrivals at ``times`` (sorted) of ``prompts[i]`` fresh prompt tokens asking
    ``answers[i]`` tokens through ``replica`` under ``policy``, until every request has ended."""
    count = len(times)
    first, end = np.full(count, np.nan), np.full(count, np.nan)
    tokens = np.zeros(count, dtype=np.int64)
    waiting: collections.deque[int] = collections.deque()
    index: dict[int, int] = {}
    following = 0
    while following < count or waiting or replica.engine.has_work:
        while following < count and times[following] <= replica.now:
            waiting.append(following)
            following += 1
        room = policy(replica)
        while waiting and room > 0:
            request = waiting.popleft()
            index[replica.add(int(prompts[request]), answer=int(answers[request]))] = request
            room -= 1
        if not replica.engine.has_work:
            if following < count:
                replica.now = max(replica.now, float(times[following]))
            continue
        output, _ = replica.step()
        for rid in output.tokens:
            request = index[rid]
            if not tokens[request]:
                first[request] = replica.now
            tokens[request] += 1
        for ended in output.finished:
            end[index.pop(ended.rid)] = replica.now
    return Served(np.asarray(times, dtype=float), first, end, tokens, replica.now)


def sweep(run: Callable[[float], dict], rates: Sequence[float], go_on: Callable[[dict], bool]) -> list[dict]:
    """Run each of the rising ``rates`` until one's row fails ``go_on``; every row run."""
    rows = []
    for rate in rates:
        rows.append(run(rate))
        if not go_on(rows[-1]):
            break
    return rows


def highest(rows: Sequence[dict], meets: Callable[[dict], bool], key: str = "req/s") -> float:
    """The highest rate of rising ``rows`` that meets, with every row before it (0 if none)."""
    best = 0.0
    for row in rows:
        if not meets(row):
            break
        best = row[key]
    return best


def refine(
    run: Callable[[float], dict], rows: Sequence[dict], meets: Callable[[dict], bool], times: int = 2
) -> float:
    """:func:`highest` of a :func:`sweep`'s ``rows``, narrowed by bisecting ``times`` between it and
    the first rate that failed (the rates a sweep tries are coarse)."""
    low = highest(rows, meets)
    failed = [row["req/s"] for row in rows if not meets(row)]
    if not failed:
        return low
    high = failed[0]
    for _ in range(times):
        middle = (low + high) / 2
        if meets(run(middle)):
            low = middle
        else:
            high = middle
    return low
