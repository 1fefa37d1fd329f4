"""The TPOT targets in the configuration: a tier's ``tpot_target_ms``, a continuous model's
``step_costs``, and the rule that a target is set only where every continuous model holds it."""

from __future__ import annotations

import re

import pytest

from gateway.config import parse_config

TIERS = """
[[tiers]]
name = "paid"
tpot_target_ms = {target}
[[tiers]]
name = "free"
"""
SIMULATED = """
[[models]]
name = "sim@1"
mode = "continuous"
simulated = "llama-70b"
"""


def test_the_tiers_targets_reach_the_queue_settings_in_seconds():
    config = parse_config(TIERS.format(target=50) + SIMULATED, "f.toml")
    assert config.queue().tpot_targets == (0.05, 0.0)
    assert config.queue().tpot_target(1) == 0.0
    assert parse_config(TIERS.format(target=0) + SIMULATED, "f.toml").queue().tpot_targets is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (TIERS.format(target=-1) + SIMULATED,
         "tiers[0].tpot_target_ms: expected milliseconds >= 0 (0: none)"),
        (TIERS.format(target=50) + SIMULATED.replace('simulated = "llama-70b"', 'model = "smollm2-135m"'),
         "models[0].step_costs: expected a file `ferry fit` wrote, where a tier sets tpot_target_ms"),
        (TIERS.format(target=0) + SIMULATED + 'step_costs = "/nonexistent/costs.json"\n',
         "step_costs: expected a file `ferry fit` wrote (its engines read it at start)"),
    ],
)
def test_a_target_that_cannot_be_held_is_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(text, "f.toml")


def test_the_step_costs_reach_the_engines_command_line(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text("{}")
    config = parse_config(TIERS.format(target=50) + SIMULATED + f'step_costs = "{costs}"\n', "f.toml")
    argv = config.models[0].engine_argv()
    assert argv[argv.index("--step-costs") + 1] == str(costs)
