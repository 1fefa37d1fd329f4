"""Weighted aliases, pure: a session always lands on the same version, the versions' shares of
many sessions match the weights, a weight shift moves only the band that changed hands, and the
catalog routes an alias (or refuses a name) as the configuration says."""

from __future__ import annotations

import collections
import itertools

import pytest

from batcher.fixed.config import FixedModelConfig
from gateway.config import AliasConfig
from gateway.ops.models import Catalog
from gateway.ops.routing import Split, session_point
from gateway.wire import api

SESSIONS = [f"user-{i}" for i in range(20_000)]


def shares(split: Split) -> dict[str, float]:
    counts = collections.Counter(split.pick(session) for session in SESSIONS)
    return {version: counts[version] / len(SESSIONS) for version in split.shares}


def test_a_session_point_is_sha256_not_pythons_salted_hash():
    # Pinned: every gateway process (and every restart) must put a session at the same point.
    assert session_point("ferry-large", "user-1") == 0.7248883605296774
    assert session_point("ferry-large", "user-2") == 0.058477662002584606
    assert session_point("other", "user-1") == 0.3260652693943758  # the alias is part of the hash


def test_one_session_sees_one_version_every_time_and_the_bands_are_in_name_order():
    split = Split("ferry-large", (("ferry-large@2", 5), ("ferry-large@1", 95)))
    assert split.weights == (("ferry-large@1", 95), ("ferry-large@2", 5))
    assert {split.pick("user-2") for _ in range(100)} == {"ferry-large@1"}
    # user-2's point 0.058 is inside @1's band [0, 0.95); a point past 0.95 is @2's
    late = next(s for s in SESSIONS if session_point("ferry-large", s) >= 0.95)
    assert split.pick(late) == "ferry-large@2"


@pytest.mark.parametrize("weights", [(95, 5), (50, 50), (0, 100), (100, 0), (1, 3)])
def test_the_shares_of_many_sessions_match_the_weights_within_a_point(weights):
    split = Split("m", (("m@1", weights[0]), ("m@2", weights[1])))
    observed = shares(split)
    for version, share in split.shares.items():
        assert abs(observed[version] - share) < 0.01, (version, observed)


def test_shifting_weight_moves_only_sessions_in_the_band_that_changed_hands():
    stages = [Split("m", (("m@1", 100 - w), ("m@2", w))) for w in (0, 5, 20, 50, 100)]
    picks = [{session: split.pick(session) for session in SESSIONS} for split in stages]
    for before, after in itertools.pairwise(picks):
        moved = [s for s in SESSIONS if before[s] != after[s]]
        assert all(
            before[s] == "m@1" and after[s] == "m@2" for s in moved
        )  # the canary never gives users back


def test_a_split_among_the_versions_that_can_serve():
    split = Split("m", (("m@1", 1), ("m@2", 3), ("m@3", 0)))
    assert split.among({"m@2", "m@3"}) == Split("m", (("m@2", 3), ("m@3", 0)))
    assert split.among({"m@3"}) is None  # no weight left: the alias cannot route
    with pytest.raises(ValueError, match="m: expected weights >= 0 adding up to more than 0"):
        Split("m", (("m@1", 0),))


def test_the_catalog_routes_weighted_and_plain_aliases_and_names_what_it_knows():
    models = [FixedModelConfig(name=f"m@{i}", worker=("echo",), aliases=("latest",) if i == 2 else ())
              for i in (1, 2)]
    catalog = Catalog.of(models, [AliasConfig("m", (("m@1", 1), ("m@2", 1)))])
    assert catalog.resolve("latest", "anyone").name == "m@2"
    assert catalog.resolve("m@1", "anyone").name == "m@1"
    assert {catalog.resolve("m", s).name for s in SESSIONS[:200]} == {"m@1", "m@2"}
    assert catalog.resolve("m", "user-2").name == Split("m", (("m@1", 1), ("m@2", 1))).pick("user-2")
    with pytest.raises(api.NotFound, match="'m@3' is not served here; try one of: latest, m, m@1, m@2"):
        catalog.resolve("m@3")
