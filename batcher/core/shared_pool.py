"""A shared pool's pure core: a fixed number of slots (GPUs) that several rarely used model
versions take turns on (``[[pools]]``, a model's ``pool = "rare"``).

A version holds a slot for each worker it has staffed (starting, serving or draining), and
holds none while it has no work and no worker. When its scaler wants a worker, it claims a
slot: a free one at once; else the member idle longest (no work queued or in flight) is evicted,
its workers retired (an idle one stops at once, a busy one drains first), and the slot freed
goes to the next claim once its worker has stopped. A pool whose every slot a busy version
holds evicts nobody: the claimer's requests wait for a slot within their wait budget, or are
refused by the cold-start rule (503 with the time to ready). Pure: the trio shell is
:mod:`batcher.core.scaling`, which reports each member's state at its tick and acts on claims."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(slots=True)
class Member:
    """A version in the pool, as last reported at its scaler's tick."""

    held: int = 0  # slots its staffed workers hold
    idle_since: float = math.inf  # when it last had work (inf: it has work now)
    evicting: bool = False  # told to give its slots back; cleared once it holds none


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """What a claim got: slots granted now, and the members evicted to free more."""

    granted: int
    evict: tuple[str, ...] = ()


class SharedPool:
    """The slots of one ``[[pools]]`` table and the versions that name it (see the module doc)."""

    def __init__(self, name: str, slots: int) -> None:
        self.name = name
        self.slots = slots
        self.members: dict[str, Member] = {}

    def join(self, version: str) -> None:
        self.members.setdefault(version, Member())

    def leave(self, version: str) -> None:
        """A version closed: its workers are stopped, its slots free."""
        self.members.pop(version, None)

    @property
    def free(self) -> int:
        return max(0, self.slots - sum(member.held for member in self.members.values()))

    def seen(self, version: str, held: int, working: bool, now: float) -> None:
        """``version`` holds ``held`` slots at ``now``, and has work queued or in flight or not."""
        member = self.members[version]
        member.held = held
        member.idle_since = math.inf if working else min(member.idle_since, now)
        member.evicting = member.evicting and held > 0

    def claim(self, version: str, wanted: int) -> Claim:
        """``version`` wants ``wanted`` more workers: the free slots it gets now (counted as
        held at once, so that no other claim is granted them), and the idle members evicted,
        idle longest first, to free enough for the rest; never a member with work."""
        member = self.members[version]
        granted = min(wanted, self.free)
        member.held += granted
        need = wanted - granted - sum(m.held for m in self.members.values() if m.evicting)
        evict: list[str] = []
        idle = sorted(((m.idle_since, name) for name, m in self.members.items()
                       if name != version and m.held and not m.evicting and m.idle_since < math.inf))
        for _, name in idle:
            if need <= 0:
                break
            self.members[name].evicting = True
            evict.append(name)
            need -= self.members[name].held
        return Claim(granted, tuple(evict))
