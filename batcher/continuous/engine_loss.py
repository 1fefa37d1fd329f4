"""What becomes of a job whose engine died under it: pure, one rule per model.

A job that has shown its client nothing is re-run from its prompt, unseen. A stream that has
shown text ends with a retryable error under ``on_engine_loss = "error"``; under ``"resume"``
it goes on on another engine from where it was: its prompt and the ids it had taken are
computed again there (a preemption by recompute, on another engine), and its next token is
sampled as the same index with the same seed, so the client reads the text the dead engine
would have sent. Each loss counts against ``max_attempts``, a resumed one's too; a resumed one
whose ``max_tokens`` was reached in full (its end frame lost) ends there.
"""

from __future__ import annotations

import enum


class Fate(enum.Enum):
    RERUN = "rerun"  # from its prompt, unseen
    RESUME = "resume"  # from where it was, its client's stream unbroken
    INTERRUPT = "interrupt"  # a stream ended by a retryable error (ReplicaLost)
    FAIL = "fail"  # lost max_attempts times before it showed anything (500)
    COMPLETE = "complete"  # it had all its max_tokens: it ends now


def fate(
    *, sent: int, generated: int, max_tokens: int, attempts: int, max_attempts: int, resume: bool
) -> Fate:
    """The fate of a job lost for the ``attempts``-th time, having shown ``sent`` tokens and
    taken ``generated`` of its ``max_tokens``, under a model that ``resume``\\ s streams."""
    if sent and resume and generated >= max_tokens:
        return Fate.COMPLETE
    if attempts >= max_attempts:
        return Fate.INTERRUPT if sent else Fate.FAIL
    if sent:
        return Fate.RESUME if resume else Fate.INTERRUPT
    return Fate.RERUN
