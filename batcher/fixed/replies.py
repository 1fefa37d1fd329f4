"""Whether a fixed-mode worker's reply answers its call: one output per input run, of the kind
the model answers with. A reply that does not fails its call alone (the worker lives on), with
a reason a caller may be told: what went wrong, never where."""

from __future__ import annotations

from batcher.core.config import Outputs
from workers.protocol import Error, Result


def wrong_outputs(reply: Result, expected: Outputs) -> str:
    """Why a reply's outputs are not what the model answers with (empty if they are): vectors
    from a text model, texts from an embedding model, or a vector of the wrong length."""
    if expected.kind == "text":
        return "the model returned vectors, not texts" if reply.vectors else ""
    if reply.outputs:
        return "the model returned texts, not vectors"
    size = 4 * expected.dimensions
    wrong = next((len(vector) for vector in reply.vectors if len(vector) != size), None)
    if wrong is None:
        return ""
    return f"the model returned a vector of {wrong / 4:g} values, not {expected.dimensions}"


def reply_fault(reply: Result | Error, ran: int, expected: Outputs) -> str:
    """Why a reply to a call that ran ``ran`` inputs fails it (empty if it answers them): the
    model raised (named by the exception's type alone: its message may quote the input), it
    returned another number of outputs, or outputs of the wrong kind."""
    if isinstance(reply, Error):
        kind = reply.message.partition(":")[0]
        return f"the model raised {kind if kind.isidentifier() else 'an error'}"
    if len(reply.answers) != ran:
        return f"the model returned {len(reply.answers)} outputs for {ran} inputs"
    return wrong_outputs(reply, expected)
