"""L8: which signal an autoscaler should follow when answers grow from 20 to 500 tokens at a
constant request rate.

One 70B replica on 4 x A100 (L7's) takes 20 req/s of 200 prompt tokens through the production
pool, router and admission: 20-token answers for 60 s, 500-token answers after. The replay
measures each second the arrivals, the replica's KV use and the tokens still owed; the scalers
are a model over those signals (each fires when its 30 s mean is 30 % above its mean before the
shift, and its replica serves 8 minutes later), with a KV scaler at an absolute 70 % beside
them. The claim and the figures: experiments/docs/continuous-overload.md.

    python -m experiments.continuous_autoscale
"""

from __future__ import annotations

import numpy as np

from batcher.core.config import QueueConfig
from batcher.sim.arrivals import poisson
from batcher.sim.continuous.replay import FINISHED, Outcomes
from batcher.sim.continuous.workload import Workload
from experiments.common import plt, write
from experiments.continuous_common import KV_BLOCKS_SMALL_70B, SMALL_70B, pool_replay

RATE, PROMPT, SHORT, LONG, SHIFT, END = 20.0, 200, 20, 500, 60, 180
WINDOW, HEADROOM, START_S, BIN, KV_FULL = 30, 1.3, 480, 15, 70.0


def owed_tokens(out: Outcomes, workload: Workload, at: np.ndarray) -> np.ndarray:
    """At each time of ``at``: prompt tokens of requests sent and not started, plus answer
    tokens not yet made of requests started (made at an even pace from first token to end)."""
    owed = np.zeros(len(at))
    first = np.where(np.isnan(out.first), out.end, out.first)
    for k, t in enumerate(at):
        waiting = (out.sent <= t) & (first > t)
        running = (first <= t) & (out.end > t)
        made = (t - first[running]) / np.maximum(out.end[running] - first[running], 1e-9)
        owed[k] = workload.prompt[waiting].sum() + (workload.answer[waiting]).sum()
        owed[k] += ((1 - made) * workload.answer[running]).sum()
    return owed


def fires(signal: np.ndarray) -> float:
    """Seconds after the shift a scaler on ``signal`` (one value a second) fires; inf if never."""
    before = signal[:SHIFT].mean()
    for t in range(SHIFT, len(signal)):
        if signal[max(0, t - WINDOW + 1) : t + 1].mean() > HEADROOM * before:
            return float(t - SHIFT)
    return float("inf")


def main() -> None:
    times = poisson(RATE, END, 8)
    answers = np.where(times < SHIFT, SHORT, LONG)
    count, none = len(times), np.full(len(times), -1)
    tier = np.zeros(count, dtype=np.int8)
    workload = Workload(times, tier, np.full(count, PROMPT), answers, none, none, ("paid",), 0)
    queue = QueueConfig(tiers=("paid",), wait_budgets=(30.0,))
    run = pool_replay(workload, queue, cost=SMALL_70B, num_blocks=KV_BLOCKS_SMALL_70B)
    out = run.outcomes
    seconds = np.arange(END)
    signals = {
        "req/s": np.histogram(times, bins=np.arange(END + 1))[0].astype(float),
        "KV use %": 100 * run.kv_use[:END, 0],
        "tokens owed": owed_tokens(out, workload, seconds + 1.0),
    }
    ttft = out.first - out.sent
    done = out.outcome == FINISHED
    rows = []
    for start in range(0, END, BIN):
        mine = (out.sent >= start) & (out.sent < start + BIN) & done
        row: dict = {"from s": start}
        for name, signal in signals.items():
            row[name] = round(float(signal[start : start + BIN].mean()), 1)
        row["TTFT p95 ms"] = round(float(np.percentile(ttft[mine], 95)) * 1000) if mine.any() else 0
        row["shed"] = int(((out.sent >= start) & (out.sent < start + BIN) & ~done).sum())
        rows.append(row)
    late = {name: fires(signal) for name, signal in signals.items()}
    ratio = {name: signal[-WINDOW:].mean() / signal[:SHIFT].mean() for name, signal in signals.items()}
    after = (out.sent >= SHIFT) & done
    kv = signals["KV use %"]
    kv_peak = max(kv[max(0, t - WINDOW + 1) : t + 1].mean() for t in range(len(kv)))

    def when(name: str) -> str:
        return "never" if np.isinf(late[name]) else f"{late[name]:.0f} s after the shift"

    summary = (
        f"{RATE:g} req/s of {PROMPT} prompt tokens on one 70B replica (4 x A100); answers {SHORT} -> {LONG} "
        f"tokens at {SHIFT} s. Over the last {WINDOW} s against the first {SHIFT} s: requests/s "
        f"x{ratio['req/s']:.2f}, KV use x{ratio['KV use %']:.1f} (to {kv[-WINDOW:].mean():.0f} %), "
        f"tokens owed x{ratio['tokens owed']:.1f}. "
        f"A scaler firing at +30 % on requests/s fires {when('req/s')}; on KV use {when('KV use %')}; on "
        f"tokens owed {when('tokens owed')} (mean over {WINDOW} s); one on KV use above an absolute "
        f"{KV_FULL:g} % {'never fires' if kv_peak <= KV_FULL else 'fires'} (its {WINDOW} s mean peaks at "
        f"{kv_peak:.0f} %: the 256-sequence cap binds before the cache fills). Meanwhile TTFT p95 goes from "
        f"{rows[0]['TTFT p95 ms']:,} ms to {rows[-1]['TTFT p95 ms']:,} ms in the last {BIN} s "
        f"({(~done).sum():,} of {len(workload):,} shed or expired), and a replica ordered on the "
        f"token signals serves only {START_S // 60} minutes later; the requests/s scaler never orders "
        f"one. Of the requests sent after the shift, {after.sum():,} finished."
    )
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, signal in signals.items():
        axis.plot(seconds, signal / signal[:SHIFT].mean(), label=f"{name} / its level before")
    axis.axvline(SHIFT, color="grey", linestyle=":")
    axis.axhline(HEADROOM, color="grey", linestyle="--")
    axis.set_yscale("log")
    axis.set_xlabel("virtual seconds (answers 20 -> 500 tokens at 60 s)")
    axis.set_ylabel("signal over its level before the shift")
    axis.legend()
    axis.set_title("Autoscaling signals at a constant 20 req/s")
    write("continuous_autoscale", rows, figure, summary, "python -m experiments.continuous_autoscale")


if __name__ == "__main__":
    main()
