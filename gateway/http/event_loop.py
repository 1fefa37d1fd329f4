"""The asyncio event loop the gateway and its HTTP load generators run on: uvloop where it is
installed (a dependency on every platform but Windows), plain asyncio without it.

uvloop's libuv loop spends less CPU per socket event than asyncio's selector loop, and on a
machine whose cores the gateway shares with its workers (and, in a benchmark, with the client
that loads it) that CPU is what every request waits for. The fallback keeps the gateway running
where uvloop does not build."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop if it imports."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
