"""How long an engine may go unheard before the pool takes it for hung. Pure.

An engine sends ``stats`` about every 200 ms between its steps; one that sends none for
``stats_timeout`` is killed. A step can outlast that on a busy CPU (a long prompt's prefill), so
an engine announces a step it expects to be long (a ``step`` frame with its expected seconds,
from its own prices and measurements: ``workers.engine.step_forecast``) as the step starts, and
for that step the limit becomes::

    max(stats_timeout, min(max_step, STEP_SLACK x expected))

from the moment the announcement arrives; the next ``stats`` frame (which an engine sends as an
announced step ends) or announcement sets it again. ``STEP_SLACK`` leaves room for a CPU busier
than when the engine measured its steps. ``max_step`` bounds what any announcement buys: an
engine cannot announce its way out of the watch (inf or a huge figure is ``max_step``), so a
hung engine is killed at the latest ``max_step`` (or ``stats_timeout``, if longer) after its
last word. An engine that announces nothing (vLLM's, or a short step) is held to
``stats_timeout`` as before.
"""

from __future__ import annotations

import dataclasses

STEP_SLACK = 4.0
"""An announced step may take this many times what its engine expects before it is a hang."""


@dataclasses.dataclass(frozen=True, slots=True)
class SilenceLimit:
    """An engine's silences allowed, in seconds: between steps (``stats_timeout``) and, at
    most, during an announced step (``max_step``; an announcement never shortens the silence
    allowed below ``stats_timeout``)."""

    stats_timeout: float
    max_step: float

    def of_step(self, expected: float) -> float:
        """Seconds of silence allowed a step announced as taking ``expected`` (module doc)."""
        return max(self.stats_timeout, min(self.max_step, STEP_SLACK * expected))
