"""What a million tokens cost: the price of the GPU hours a model's workers hold over the tokens
they answer in that time (prompt and answer tokens, as billed). Pure.

    cost per million tokens = worker_hour_price x workers / 3600 / tokens per second x 1e6

``worker_hour_price`` is a model's ``gpu_hour_price`` times the GPUs one worker holds. Every
worker up counts, busy or idle: an idle one is paid for too, so the figure rises as load falls.
"""

from __future__ import annotations

import math


def cost_per_million_tokens(worker_hour_price: float, workers: float, tokens_per_second: float) -> float:
    """The cost of a million tokens at this rate (NaN while no token is answered)."""
    if tokens_per_second <= 0:
        return math.nan
    return worker_hour_price * workers / 3600 / tokens_per_second * 1e6
