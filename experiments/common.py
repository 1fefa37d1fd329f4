"""What every experiment shares: scenarios of the reference fleet, and writing a table, a plot and a
summary into ``experiments/results/`` (git-ignored; README copies live in ``experiments/figures/``).

The reference GPU of the fixed mode's contract: ``run_batch`` of 1..50 inputs takes 200 ms at any size, so one
worker serves at most 50 / 0.2 = 250 requests per second. Every experiment runs the production
batcher and pool over simulated workers in virtual time (:mod:`batcher.sim.fixed.simulate`).
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt

from batcher.sim.arrivals import Trace, poisson
from batcher.sim.fixed.simulate import Scenario, Simulation, simulate

RESULTS = Path(__file__).resolve().parent / "results"
SERVICE = 0.200  # seconds per call, any batch size
PER_GPU = 50 / SERVICE  # requests per second one worker serves in full batches
SLO = 0.500  # the p95 budget of the fixed mode's exercise
HALF = {"paid": 0.5, "free": 0.5}

# Every policy at the settings the experiments compare (SlackDriven needs each request's
# deadline: it gets the 500 ms p95 budget; the others keep the 30 s queue timeout).
POLICIES: dict[str, dict[str, Any]] = {
    "size_or_timeout": {},
    "idle_aware": {},
    "slack_driven": {},
    "aimd": {},
    "static": {},
    "no_batching": {},
}


def poisson_scenario(
    rate: float, duration: float, policy: str = "size_or_timeout", seed: int = 0, **fields: Any
) -> Scenario:
    """Poisson arrivals, half paid and half free, on the reference GPU."""
    budget = SLO if policy == "slack_driven" else None
    trace = Trace.of(poisson(rate, duration, seed), HALF, seed, budget)
    return Scenario(trace, policy=policy, params=POLICIES.get(policy, {}), seed=seed, **fields)


def run(scenario: Scenario, label: str = "") -> Simulation:
    """Simulate and say so on stderr, so a long sweep shows where it is."""
    result = simulate(scenario)
    report = result.report
    print(
        f"  {label or scenario.policy}: {report.offered:,} requests, "
        f"p95 {report.latency.p95 * 1000:,.0f} ms, "
        f"dropped {report.dropped}, {result.cpu_seconds:.1f} CPU s",
        file=sys.stderr,
        flush=True,
    )
    return result


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1) if not math.isnan(seconds) else math.nan


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of equal keys as a markdown table."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:,.1f}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def write(name: str, rows: Sequence[dict[str, Any]], figure: plt.Figure, summary: str, command: str) -> None:
    """``results/NAME.csv``, ``NAME.png`` and ``NAME.md`` (the summary, the command, the table)."""
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{name}.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    figure.tight_layout()
    figure.savefig(RESULTS / f"{name}.png", dpi=90)
    plt.close(figure)
    text = f"# {name}\n\n{summary.strip()}\n\n```sh\n{command}\n```\n\n{markdown(rows)}\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    print(f"wrote {RESULTS}/{name}.{{csv,png,md}}", file=sys.stderr)
