"""Weighted aliases: which version of a model answers a client, stable per session. Pure.

A rollout shifts traffic by session, never by request (a conversation that hops between
versions changes its style mid-way). A :class:`Split` places each session at a fixed point of
[0, 1) (a hash of the alias and the session key) and lays the versions' shares end to end::

    weights  @1 = 95, @2 = 5          @1 = 50, @2 = 50            @1 = 0, @2 = 100
    [0, 1)   |====== @1 ======|@2|    |=== @1 ===|=== @2 ===|      |======== @2 ========|
                       ^ a session's point: the same alias and key land here every time

Moving weight moves only the sessions in the band that changed hands. The session key is
``metadata.user_id`` (Anthropic) or ``user`` (OpenAI), else the API key's id."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

_SCALE = float(1 << 64)


def session_point(alias: str, session: str) -> float:
    """Where a session falls in [0, 1) for an alias: the same inputs, the same point, in every
    process (sha256, not Python's salted ``hash``), so several gateways agree."""
    digest = hashlib.sha256(f"{alias}\0{session}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """An alias's versions and their weights; :meth:`pick` says which one a session gets."""

    alias: str
    weights: tuple[tuple[str, float], ...]  # (version, weight >= 0), at least one weight > 0
    _bands: tuple[tuple[float, str], ...] = dataclasses.field(init=False, repr=False, compare=False)
    """Each version with weight and the top of its band, in [0, 1]."""

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.weights))  # bands in name order, however the weights were given
        object.__setattr__(self, "weights", ordered)
        total = sum(w for _, w in ordered)
        if not ordered or any(w < 0 for _, w in ordered) or total <= 0:
            raise ValueError(
                f"{self.alias}: expected weights >= 0 adding up to more than 0, got {dict(ordered)}"
            )
        tops = itertools.accumulate(w / total for _, w in ordered)
        object.__setattr__(
            self, "_bands", tuple((top, v) for (v, w), top in zip(ordered, tops, strict=False) if w > 0)
        )

    @property
    def shares(self) -> dict[str, float]:
        """Each version's share of the sessions, in 0..1."""
        total = sum(w for _, w in self.weights)
        return {version: weight / total for version, weight in self.weights}

    def pick(self, session: str) -> str:
        """The version whose band holds this session's point (no hashing when one version
        has all the weight: a model's own alias, on every request)."""
        bands = self._bands
        if len(bands) > 1:
            point = session_point(self.alias, session)
            for top, version in bands:
                if point < top:
                    return version
        return bands[-1][1]  # the only one, or rounding at the very top of the interval

    def among(self, versions: set[str]) -> Split | None:
        """The split over only these versions (the others cannot take traffic now); None if
        none of them has any weight."""
        kept = tuple((v, w) for v, w in self.weights if v in versions)
        if sum(w for _, w in kept) <= 0:
            return None
        return Split(self.alias, kept)
