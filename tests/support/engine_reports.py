"""A continuous model's engines as ``/readyz`` shows them: each replica's state from its engine's
last ``stats`` report (one every ~200 ms) and how old that report is (``stats_age_ms``).

``/metrics``' engine counters (prefix-cache queries and hits, generated tokens) move only with
those reports, so a test that reads them after some work first waits for a report of every
replica taken after that work: :func:`reported_after`."""

from __future__ import annotations

import time

from tests.support.gateway_process import Gateway
from tests.support.waiting import until

IDLE = ("running", "waiting", "used_blocks", "queued", "load_tokens")


def reported_after(gateway: Gateway, model: str, moment: float, idle: bool = False,
                   within: float = 30.0) -> list[dict]:
    """Each replica of ``model`` from ``/readyz``, once its engine's last report came after
    ``moment`` (``time.monotonic()`` here); with ``idle``, once that report also shows the engine
    running nothing and the pool owes it nothing, so that its counters are final."""

    def fresh() -> list[dict] | None:
        asked = time.monotonic()  # the gateway looks after this: a report as old as it says came after
        workers = gateway.ready()["models"][model]["workers"]
        for worker in workers:
            if "stats_age_ms" not in worker or asked - (worker["stats_age_ms"] + 1) / 1000 <= moment:
                return None
            if idle and any(worker[name] for name in IDLE):
                return None
        return workers

    return until(fresh, f"a report of every engine of {model} after the work{' and idle' if idle else ''}",
                 within=within, every=0.05)
