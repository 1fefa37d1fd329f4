"""``ferry fit`` on a tiny measurement set against the real SmolLM2 engine: the file it writes
loads, and prices steps above zero that grow with the tokens they compute (no timing asserted)."""

from __future__ import annotations

from gateway.cli import build_parser
from workers.engine.fit.cost_fit import load


def test_fit_writes_step_costs_that_simulate_can_load(smollm2, tmp_path, capsys):
    out = tmp_path / "costs.json"
    args = build_parser().parse_args([
        "fit", "--out", str(out), "--contexts", "16", "--batches", "2,1", "--chunks", "16,64",
        "--repeats", "1", "--max-batch-tokens", "64",
    ])
    assert args.run(args) == 0
    cost = load(str(out))
    assert cost.shape.name == "smollm2-135m"
    one = cost.step([1], [32]).seconds
    assert 0 < one < cost.step([64], [64]).seconds
    assert cost.step([1] * 2, [32] * 2).seconds <= cost.step([1] * 2 + [64], [32] * 2 + [64]).seconds
    assert "wrote" in capsys.readouterr().out
