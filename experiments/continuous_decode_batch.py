"""L1: a decode step's time and a 70B replica's tokens per second against batch size.

The production engine (scheduler, block manager) runs each batch over the cost model of 70B on
8 x H100: the sequences are prefilled, then the next decode steps are timed, so the step is what
the engine really schedules (one token per running sequence, contexts growing by one a step).
The claim it checks and the figures: experiments/docs/continuous-sizing.md.

    python -m experiments.continuous_decode_batch
"""

from __future__ import annotations

from experiments.common import write
from experiments.continuous_common import Replica, two_scales

CONTEXT = 2_000
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
TIMED = 8  # decode steps timed per batch size


def decode_step(batch: int) -> tuple[float, float]:
    """Mean seconds of a decode step with ``batch`` sequences of ~CONTEXT tokens, and their mean
    context (the first ones decode while the last prefill, so theirs grows a little beyond)."""
    replica = Replica(max_batch_tokens=8_192)  # a big budget: the batch is prefilled in few steps
    for _ in range(batch):
        replica.add(CONTEXT - 1, answer=batch + TIMED + 2)  # the prefill makes token 2,000
    while not replica.decoding():
        replica.step()
    running = replica.engine.scheduler.running
    context = sum(s.num_tokens for s in running) / batch
    seconds = [replica.step()[1] for _ in range(TIMED)]
    assert len(replica.engine.scheduler.running) == batch, "a sequence ended while timed"
    return sum(seconds) / TIMED, context


def main() -> None:
    rows = []
    for batch in BATCHES:
        step, context = decode_step(batch)
        rows.append(
            {
                "batch": batch,
                "mean context": round(context),
                "step ms": round(step * 1000, 2),
                "tok/s per user": round(1 / step, 1),
                "tok/s replica": round(batch / step),
            }
        )
    one, full = rows[0], rows[-1]
    summary = (
        f"Decode step of 70B on 8 x H100 at contexts of ~{CONTEXT:,} tokens, the production scheduler over "
        "the cost "
        f"model. Batch 1: {one['step ms']} ms, {one['tok/s replica']} tokens/s (the claim: ~5.2 ms, ~190). "
        f"Batch 256: {full['step ms']} ms, {full['tok/s per user']} tokens/s per user and "
        f"{full['tok/s replica']:,} "
        "for the replica (the claim: ~11.5 ms, ~87 and ~22,000): "
        f"{full['tok/s replica'] / one['tok/s replica']:.0f} "
        f"times the throughput for {full['step ms'] / one['step ms']:.1f} times the step. Agrees: the "
        "engine adds no "
        "step the arithmetic does not count (both are bandwidth upper bounds; a real engine loses some to "
        "scheduling, sampling and the all-reduce between GPUs)."
    )
    figure = two_scales(
        [r["batch"] for r in rows],
        [r["step ms"] for r in rows],
        [r["tok/s replica"] for r in rows],
        xlabel="sequences in the batch (contexts of 2,000 tokens)",
        left_label="decode step, ms",
        right_label="replica tokens/s",
        title="70B on 8 x H100: a decode step against batch size",
    )
    write("continuous_decode_batch", rows, figure, summary, "python -m experiments.continuous_decode_batch")


if __name__ == "__main__":
    main()
