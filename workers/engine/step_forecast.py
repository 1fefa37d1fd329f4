"""How long the engine's next step should take, announced before it runs. Pure.

The pool takes an engine that sends no ``stats`` frame for ``stats_timeout_ms`` for hung, and
the serving loop sends ``stats`` only between steps: one long step (a 2,048-token prefill on a
busy CPU takes seconds) silences a healthy engine. So, as a step starts that should take longer
than :data:`ANNOUNCED` seconds, the engine says how long in a ``step`` frame, and the pool allows
that step a multiple of it, up to a bound of its own (``batcher.continuous.silence``).

A :class:`StepForecast` is the engine's :class:`~workers.engine.interface.StepWatch`. Its figure
for a step is the larger of two:

- its price, where the engine has a cost model (``--step-costs``, the file ``ferry fit`` writes);
- what the engine measured of its own steps: seconds per computed token by size class (steps of
  ``2**(k-1) .. 2**k - 1`` tokens), the step priced at the rate of the largest class measured at
  or below its own. The cost of a token falls as a step grows (a step's fixed costs spread over
  more tokens), so scaling a smaller step up errs long, the safe side. A class's rate rises at
  once to a slower step and falls halfway to a faster one, so a CPU that just got busy is not
  forgotten a step later. A step smaller than every class measured is priced as the smallest
  step of the nearest class above.

An engine that has measured nothing and has no prices (its first step) announces ``inf``: it
cannot tell, and the pool's bound is what holds it to account. Memory: one rate per size class,
at most ~21 for a step budget of 2**20 tokens; each step costs a few float operations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from workers.engine.cost_model import CostModel
from workers.engine.loop import STATS_INTERVAL

ANNOUNCED = STATS_INTERVAL / 4
"""Seconds: a step expected to take at least this long is announced. The pool allows an
unannounced step only ``stats_timeout``; a step expected at a quarter of the stats interval is one
that a slowdown of a few times would make the engine late with its stats."""


class StepForecast:
    """Times the steps of one engine and announces the long ones (see the module doc): each
    :meth:`begin` whose figure reaches :data:`ANNOUNCED` calls ``announce(seconds)`` before the
    step runs. ``clock``: the wall clock of the engine's process."""

    def __init__(self, announce: Callable[[float], None], clock: Callable[[], float],
                 cost: CostModel | None = None) -> None:
        self._announce, self._clock, self.cost = announce, clock, cost
        self.rates: dict[int, float] = {}  # size class (a step's tokens' bit length) -> seconds per token
        self._began = math.nan
        self._tokens = 0

    def expect(self, query_lens: list[int], context_lens: list[int]) -> float:
        """Seconds the step of these lengths should take (inf: nothing to tell by)."""
        measured = self.measured(sum(query_lens))
        if self.cost is None:
            return measured
        priced = self.cost.step(query_lens, context_lens).seconds
        return priced if math.isinf(measured) else max(priced, measured)

    def measured(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` should take by the steps measured (inf: none yet)."""
        size = tokens.bit_length()
        below = [k for k in self.rates if k <= size]
        if below:
            return self.rates[max(below)] * tokens
        if not self.rates:
            return math.inf
        above = min(self.rates)
        return self.rates[above] * 2 ** (above - 1)  # the smallest step of that class

    def begin(self, query_lens: list[int], context_lens: list[int]) -> None:
        """A step of these lengths starts now: announced if it should be long."""
        seconds = self.expect(query_lens, context_lens)
        if seconds >= ANNOUNCED:
            self._announce(seconds)
        self._tokens = sum(query_lens)
        self._began = self._clock()

    def end(self) -> None:
        """The step begun last has ended: its rate joins its size class's."""
        rate = (self._clock() - self._began) / max(1, self._tokens)
        size = self._tokens.bit_length()
        known = self.rates.get(size)
        self.rates[size] = rate if known is None else max(rate, (known + rate) / 2)
