"""The ways a worker's pipe fails, as the pool sees them (:mod:`workers.protocol` raises them and
re-exports them): a frame that breaks the protocol, and a worker lost, with why."""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame broke the protocol: too large, not msgpack, not a map, unknown kind, bad fields."""


class WorkerLost(Exception):
    """The worker's end of the pipe closed: it exited, crashed or was killed."""


class ModelUnloadable(WorkerLost):
    """The worker said it could not build its model (an ``unloadable`` frame) and exited: its
    message names the exception's type and message."""


class NotDelivered(WorkerLost):
    """The worker was gone before it accepted a call (its pipe closed on send, or before the
    ``accepted`` frame): the call cannot have caused its death, so it does not count against
    the call's inputs."""
