"""What a reload does to the running versions, pure: which versions open, come back or drain,
and every change that cannot happen while ferry runs refused with the field named."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.ops.rollout import Plan, VersionState, plan

BASE = """
[[tiers]]
name = "paid"
wait_budget_ms = 1000
[[tiers]]
name = "free"
[[models]]
name = "m@1"
aliases = ["m"]
worker = ["echo"]
"""
SECOND = """
[[models]]
name = "m@2"
worker = ["echo"]
"""


def running(config, **states):
    return {
        model.name: (model, VersionState[states.get(model.name.replace("@", "_"), "SERVING")])
        for model in config.models
    }


def test_a_new_version_opens_and_a_dropped_one_drains():
    old, new = parse_config(BASE), parse_config(BASE.replace('name = "m@1"', 'name = "m@2"'))
    assert plan(old, new, running(old)) == Plan(open=(new.models[0],), revive=(), drain=("m@1",))


def test_weights_budgets_aliases_keys_and_safety_are_no_change_to_the_versions():
    old = parse_config(BASE + SECOND)
    new = parse_config(
        BASE.replace('aliases = ["m"]', "aliases = []").replace(
            "wait_budget_ms = 1000", "wait_budget_ms = 50"
        )
        + SECOND
        + "[aliases]\nm = { 'm@1' = 1, 'm@2' = 3 }\n[safety]\nblocklist = ['x']\n"
        + "[[keys]]\nkey = 'sk-0000000001'\ntenant = 't'\ntier = 'free'\n"
    )
    assert plan(old, new, running(old)) == Plan((), (), ())


def test_a_draining_version_listed_again_comes_back_and_a_stopped_one_restarts():
    old = parse_config(BASE + SECOND)
    versions = running(old, m_1="DRAINING", m_2="STOPPED")
    assert plan(old, old, versions) == Plan(open=(old.models[1],), revive=("m@1",), drain=())
    # a version whose workers are being stopped opens again once they are gone
    assert plan(old, old, running(old, m_1="STOPPING")).open == (old.models[0],)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace('worker = ["echo"]', 'worker = ["echo"]\nworkers = 3', 1),
            "models[0]: 'm@1' is running with other settings (workers); a version's settings cannot change",
        ),
        (
            lambda t: "[server]\nport = 9000\n" + t,
            "server.port: cannot change while ferry serve runs (8080 -> 9000)",
        ),
        (lambda t: "[state]\ndir = '/elsewhere'\n" + t, "state.dir: cannot change while ferry serve runs"),
        (lambda t: "[limits]\nstore = 'redis'\n" + t, "limits.store: cannot change while ferry serve runs"),
        (
            lambda t: "[admin]\nsocket = '/tmp/a.sock'\n" + t,
            "admin.socket: cannot change while ferry serve runs",
        ),
        (
            lambda t: t.replace('name = "free"', 'name = "gold"'),
            "tiers: names and order cannot change while ferry serve runs "
            "(['paid', 'free'] -> ['paid', 'gold'])",
        ),
    ],
)
def test_what_cannot_change_live_is_refused_naming_it(edit, message):
    old = parse_config(BASE)
    with pytest.raises(ValueError) as caught:
        plan(old, parse_config(edit(BASE)), running(old))
    assert str(caught.value).startswith(message)
