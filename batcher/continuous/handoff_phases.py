"""Where a prefill -> decode hand-off's pause goes: its parts, per hand-off, pure.

The pause a hand-off adds to a stream runs from its ``kv_exported`` reaching the pool (the
client has its first token then) to the decode replica's first token reaching the pool. Its
parts come from the pool's clock and from the two engines' own durations, never from one
process's clock read in another, so that they hold for engines on other hosts too::

    export   prefill engine: reading the sequence's blocks, hashing, writing its segment or
             frames (``kv_exported.seconds``; it delays the first token, not the pause)
    queued   pool: kv_exported read -> handed to a decode replica (none was up)
    send     pool: handed -> written into the decode engine's pipe (behind other frames,
             or a full pipe while that engine steps)
    wait     written -> the decode engine starts the import: the step it was in when the
             hand-off arrived, and the pipes both ways (what is left of the pause)
    import   decode engine: reading, checking and writing the KV (``kv_taken.seconds``)
    step     decode engine: import done -> the frames of its next step written
             (``kv_taken.stepped``: that step, with the sequence in it if it had room)
    after    pool: ``kv_taken`` read -> the first token read (the steps after, if the next
             one left the sequence out)

``send + wait + import + step + after`` is the pause (``ferry_engine_kv_handoff_seconds``): the
engines' durations and ``after`` are measured, ``send`` is what is left of the pause at most
(the pool's writer may note its write late), and ``wait`` is the rest. A
hand-off's parts are counted once both its ``kv_taken`` and its first token have come (in
either order: the engine writes ``kv_taken`` after that step's tokens), into one histogram per
part (``ferry_engine_kv_handoff_phase_seconds``), so every part counts the same hand-offs.
"""

from __future__ import annotations

import dataclasses
import math

from batcher.core.counters import Histogram
from workers.protocol import KvTaken

PHASES = ("export", "queued", "send", "wait", "import", "step", "after")


@dataclasses.dataclass(slots=True)
class HandoffPause:
    """One hand-off's times as they come (see the module doc): ``exported_at`` when its
    ``kv_exported`` reached the pool, ``export`` the prefill engine's seconds for it."""

    exported_at: float
    export: float
    handed_at: float = math.nan
    sent_at: float = math.nan
    token_at: float = math.nan
    taken_at: float = math.nan
    taken: KvTaken | None = None

    def sent(self, now: float) -> None:
        """Its frames are in the decode engine's pipe."""
        if math.isnan(self.sent_at):
            self.sent_at = now

    def first_token(self, now: float) -> float | None:
        """A token from the decode replica: the pause, if it is the first since the hand-off."""
        if not math.isnan(self.token_at):
            return None
        self.token_at = now
        return now - self.handed_at

    def take(self, frame: KvTaken, now: float) -> None:
        """The decode engine's ``kv_taken``."""
        self.taken, self.taken_at = frame, now

    def phases(self) -> dict[str, float] | None:
        """Its parts, in seconds; None until both its first token and ``kv_taken`` have come."""
        taken = self.taken
        if taken is None or math.isnan(self.token_at):
            return None
        after = max(0.0, self.token_at - self.taken_at)
        left = max(0.0, self.token_at - self.handed_at - taken.seconds - taken.stepped - after)
        sent = self.token_at if math.isnan(self.sent_at) else self.sent_at  # nan: its writer is late
        send = min(max(0.0, sent - self.handed_at), left)
        return {
            "export": self.export,
            "queued": self.handed_at - self.exported_at,
            "send": send,
            "wait": left - send,
            "import": taken.seconds,
            "step": taken.stepped,
            "after": after,
        }

    def settle(self, histograms: dict[str, Histogram]) -> bool:
        """Count its parts into ``histograms`` (by part) if they are all known; whether they were."""
        phases = self.phases()
        if phases is None:
            return False
        for phase, seconds in phases.items():
            histograms[phase].observe(seconds)
        return True
