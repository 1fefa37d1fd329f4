"""The gateway the TPOT-target system tests share: ``ferry serve`` with SmolLM2-135M whose step
costs come from a file that prices a decode step at 10 ms a sequence and nothing else, so the
number of sequences a target seats is the same on any machine; one paid tier with a wait budget
and a TPOT target, and two paid tenants, H (key ``PAID``) and L (key ``FREE``)."""

from __future__ import annotations

import hashlib
import pathlib

from tests.support.gateway_process import FREE, PAID, Gateway
from workers.engine.cost_model import SMOLLM2_135M, UNBOUNDED, CostModel, Overhead
from workers.engine.fit import cost_fit


def config(tmp: pathlib.Path, costs: str, budget_ms: int, target_ms: int) -> str:
    return f"""
[server]
port = 0

[[tiers]]
name = "paid"
wait_budget_ms = {budget_ms}
tpot_target_ms = {target_ms}

[[keys]]
key = "{PAID}"
tenant = "H"
tier = "paid"
[[keys]]
key_sha256 = "{hashlib.sha256(FREE.encode()).hexdigest()}"
tenant = "L"
tier = "paid"

[[models]]
name = "smollm2@1"
mode = "continuous"
model = "smollm2-135m"
kv_memory_gb = 0.25
temperature = 0.0
stats_timeout_ms = 60000
step_costs = "{costs}"

[state]
dir = "{tmp}"
"""


def tpot_gateway(tmp: pathlib.Path, budget_ms: int, target_ms: int) -> Gateway:
    """The gateway in ``tmp``, its cost file written there; the paid tier's budget and target."""
    costs = tmp / "costs.json"
    cost_fit.save(str(costs), CostModel(SMOLLM2_135M, UNBOUNDED, Overhead(seq=0.010)))
    return Gateway(tmp, config(tmp, str(costs), budget_ms, target_ms))
