"""LLM traffic to replay through the continuous mode: who asks what, when. Pure (numpy, no clock).

A :class:`Workload` is one row per request, in arrival order: its time, tier, the new prompt
tokens it brings, the answer tokens it asks for (its ``max_tokens``; a simulated engine that
never draws an end-of-sequence answers exactly that many), and optionally the conversation it
continues and the shared prefix (a system prompt, ``prefix_tokens`` long) it starts with. The
prompt the engine sees is built turn by turn (:mod:`batcher.sim.continuous.replay`)::

    prompt = shared prefix + every earlier turn of its conversation (prompts and answers) + new tokens

so a conversation's prompts grow as it goes, and its replica's prefix cache can serve all but
the new tokens. The CSV form a user replays (``ferry simulate --mode continuous --trace``)::

    timestamp,tier,prompt_tokens,answer_tokens,conversation,prefix
    0.000,paid,1500,300,,
    0.013,free,300,120,c7,system-a

``conversation`` and ``prefix`` may be any text (or empty: none). Every count is bounded, so a
hostile trace is a clear error, not a run that never ends.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence

import numpy as np

from batcher.sim.arrivals import tier_picks

MAX_TOKENS = 1 << 20
"""The most tokens a row may ask for, prompt or answer (a replica's cache bounds it anyway)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution: ``fixed`` tokens, ``uniform`` in ``[low, high]``, or ``lognormal``
    with median ``low`` and 95th percentile ``high`` (chat prompts and answers have a long tail)."""

    kind: str = "fixed"
    low: int = 100
    high: int = 100

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"lengths: expected fixed, uniform or lognormal, got {self.kind!r}")
        if not 1 <= self.low <= self.high <= MAX_TOKENS:
            raise ValueError(
                f"lengths: expected 1 <= low <= high <= {MAX_TOKENS}, got {self.low}, {self.high}"
            )

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``300`` (fixed), ``uniform:100:500`` or ``lognormal:300:1500``."""
        kind, _, rest = text.partition(":")
        low, _, high = rest.partition(":")
        try:
            bounds = (int(kind),) * 2 if not rest else (int(low), int(high))
        except ValueError:
            raise ValueError(
                f"lengths: expected N, uniform:LOW:HIGH or lognormal:MEDIAN:P95, got {text!r}"
            ) from None
        return cls("fixed" if not rest else kind, *bounds)

    def draw(self, count: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(count, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, count)
        sigma = np.log(self.high / self.low) / 1.645 if self.high > self.low else 0.0
        values = np.exp(rng.normal(np.log(self.low), sigma, count))
        return np.clip(np.rint(values), 1, MAX_TOKENS).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests to replay, in arrival order (see the module doc); -1: no conversation, no prefix."""

    times: np.ndarray
    tier: np.ndarray
    prompt: np.ndarray
    answer: np.ndarray
    conversation: np.ndarray
    prefix: np.ndarray
    tiers: tuple[str, ...]
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        columns = (self.times, self.tier, self.prompt, self.answer, self.conversation, self.prefix)
        if len({len(column) for column in columns}) != 1:
            raise ValueError("workload: every column needs one entry per request")
        if len(self.times) and (np.diff(self.times) < 0).any():
            raise ValueError("workload: arrival times must not decrease")
        for name, column in (("prompt", self.prompt), ("answer", self.answer)):
            if len(column) and not ((column >= 1) & (column <= MAX_TOKENS)).all():
                raise ValueError(f"workload: {name} tokens must be 1..{MAX_TOKENS}")
        if not 0 <= self.prefix_tokens <= MAX_TOKENS:
            raise ValueError(f"workload: prefix_tokens must be 0..{MAX_TOKENS}, got {self.prefix_tokens}")

    def __len__(self) -> int:
        return len(self.times)

    @classmethod
    def synthetic(
        cls,
        times: np.ndarray,
        shares: dict[str, float],
        prompt: Lengths,
        answer: Lengths,
        *,
        turns: int = 1,
        prefixes: int = 0,
        prefix_tokens: int = 0,
        seed: int = 0,
    ) -> Workload:
        """Arrivals at ``times`` with tiers drawn by ``shares`` and lengths from the distributions.

        With ``turns > 1`` the requests form conversations of that many turns: each arrival
        opens a new conversation or continues an open one, so that about one in ``turns``
        arrivals is a first turn (a chat trace). With ``prefixes``, each conversation starts
        with one of that many shared system prompts of ``prefix_tokens`` tokens."""
        if turns < 1:
            raise ValueError(f"turns: expected at least 1, got {turns}")
        rng = np.random.default_rng(seed + 2)
        count = len(times)
        conversation = np.full(count, -1, dtype=np.int64)
        if turns > 1:
            conversation = rng.integers(0, max(1, count // turns), count)
        prefix = np.full(count, -1, dtype=np.int64)
        if prefixes > 0:
            key = conversation if turns > 1 else np.arange(count)
            prefix = key % prefixes
        return cls(
            np.asarray(times, dtype=float),
            tier_picks(count, shares, seed),
            prompt.draw(count, rng),
            answer.draw(count, rng),
            conversation,
            prefix,
            tuple(shares),
            prefix_tokens if prefixes else 0,
        )

    @classmethod
    def read(cls, path: str, tiers: Sequence[str], prefix_tokens: int = 0) -> Workload:
        """Read a CSV trace (see the module doc); times shift to start at 0, rows sort by time,
        and a bad row is an error naming its line."""
        index = {name: i for i, name in enumerate(tiers)}
        names: dict[str, dict[str, int]] = {"conversation": {}, "prefix": {}}
        rows: list[tuple[float, int, int, int, int, int]] = []
        with open(path, newline="") as source:
            reader = csv.DictReader(source)
            needed = {"timestamp", "tier", "prompt_tokens", "answer_tokens"}
            if reader.fieldnames is None or not needed <= set(reader.fieldnames):
                raise ValueError(
                    f"{path}: expected a header with timestamp,tier,prompt_tokens,answer_tokens"
                    f"[,conversation][,prefix], got {reader.fieldnames}"
                )
            for row in reader:
                line = reader.line_num
                try:
                    time, prompt, answer = (
                        float(row["timestamp"]),
                        int(row["prompt_tokens"]),
                        int(row["answer_tokens"]),
                    )
                except ValueError as exc:
                    raise ValueError(f"{path}:{line}: {exc}") from None
                if not (np.isfinite(time) and 1 <= prompt <= MAX_TOKENS and 1 <= answer <= MAX_TOKENS):
                    raise ValueError(
                        f"{path}:{line}: expected a finite timestamp and token counts 1..{MAX_TOKENS}"
                    )
                if row["tier"] not in index:
                    raise ValueError(
                        f"{path}:{line}: tier: expected one of {list(tiers)}, got {row['tier']!r}"
                    )
                conversation, prefix = (
                    -1 if not row.get(key) else names[key].setdefault(row[key], len(names[key]))
                    for key in ("conversation", "prefix")
                )
                rows.append((time, index[row["tier"]], prompt, answer, conversation, prefix))
        if not rows:
            raise ValueError(f"{path}: the trace has no request")
        rows.sort(key=lambda r: r[0])
        columns = list(zip(*rows, strict=False))
        times = np.asarray(columns[0]) - columns[0][0]
        prompts, answers, conversations, prefixes = (np.asarray(c, dtype=np.int64) for c in columns[2:])
        return cls(
            times,
            np.asarray(columns[1], dtype=np.int8),
            prompts,
            answers,
            conversations,
            prefixes,
            tuple(tiers),
            prefix_tokens if names["prefix"] else 0,
        )

    def write(self, path: str) -> None:
        with open(path, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["timestamp", "tier", "prompt_tokens", "answer_tokens", "conversation", "prefix"])
            for i in range(len(self)):
                conversation, prefix = int(self.conversation[i]), int(self.prefix[i])
                writer.writerow(
                    [
                        f"{self.times[i]:.6f}",
                        self.tiers[self.tier[i]],
                        int(self.prompt[i]),
                        int(self.answer[i]),
                        "" if conversation < 0 else f"c{conversation}",
                        "" if prefix < 0 else f"p{prefix}",
                    ]
                )
