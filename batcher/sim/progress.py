"""Where a long virtual-time run stands, and the one-line report ``ferry simulate`` prints on
stderr (both modes)."""

from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """Where a long run stands, handed to the ``progress`` callback every so many virtual seconds."""

    virtual_seconds: float
    trace_seconds: float
    ended: int
    total: int
    cpu_seconds: float


def print_progress(state: Progress) -> None:
    """A one-line progress report on stderr (``ferry simulate`` uses it on long runs)."""
    share = state.ended / state.total
    rate = state.ended / state.cpu_seconds if state.cpu_seconds > 0 else 0.0
    print(
        f"  {state.virtual_seconds:,.0f} of {state.trace_seconds:,.0f} virtual s, "
        f"{state.ended:,} of {state.total:,} requests ended ({share:.0%}), {rate:,.0f} per CPU s",
        file=sys.stderr,
        flush=True,
    )
