"""TierQueues without any event loop: order, removal, deadlines and aging, with exact ids."""

import dataclasses
import enum
import math

import pytest

from batcher.core.tier_queue import TierQueues
from batcher.fixed.request import Request, RequestState

PAID, FREE = 0, 1


def request_queues(tiers, **settings):
    """Queues of the fixed mode's requests."""
    return TierQueues(tiers, waiting=RequestState.QUEUED, taken=RequestState.DISPATCHED, **settings)


def make(ident, tier, arrival=0.0, deadline=math.inf):
    return Request(ident, f"in-{ident}", tier, arrival, deadline, on_done=lambda r: None)


def fill(queues, *specs):
    requests = [make(*spec) for spec in specs]
    for request in requests:
        queues.push(request)
    return requests


def ids(batch):
    return [request.id for request in batch]


def test_paid_goes_first_and_free_fills_the_spare_slots_in_arrival_order():
    queues = request_queues(2)
    fill(queues, (1, FREE), (2, PAID), (3, FREE), (4, PAID), (5, FREE))
    assert ids(queues.take(4, now=0.0)) == [2, 4, 1, 3]
    assert ids(queues.take(4, now=0.0)) == [5]
    assert len(queues) == 0


def test_taken_requests_are_dispatched_and_leave_the_count():
    queues = request_queues(2)
    requests = fill(queues, (1, PAID), (2, FREE))
    queues.take(1, now=0.0)
    assert requests[0].state is RequestState.DISPATCHED
    assert requests[1].state is RequestState.QUEUED
    assert (len(queues), queues.queued(PAID), queues.queued(FREE)) == (1, 0, 1)


def test_a_cancelled_request_leaves_the_count_at_once_and_is_never_taken():
    queues = request_queues(2)
    first, _second, _third = fill(queues, (1, PAID, 0.0), (2, PAID, 0.1), (3, FREE, 0.2))
    first.cancel(now=0.3)
    queues.discard(first)
    assert len(queues) == 2
    assert queues.oldest_arrival() == 0.1
    assert ids(queues.take(5, now=0.3)) == [2, 3]


def test_discarding_a_queued_request_is_refused():
    queues = request_queues(1)
    (request,) = fill(queues, (1, PAID))
    with pytest.raises(ValueError, match="must leave the QUEUED state"):
        queues.discard(request)


def test_oldest_arrival_looks_across_tiers():
    queues = request_queues(2)
    assert queues.oldest_arrival() is None
    fill(queues, (1, PAID, 5.0), (2, FREE, 3.0))
    assert queues.oldest_arrival() == 3.0


def test_expired_requests_come_out_in_deadline_order_and_leave_the_count():
    queues = request_queues(2)
    fill(queues, (1, PAID, 0.0, 9.0), (2, FREE, 0.0, 4.0), (3, PAID, 0.0, 6.0), (4, FREE, 0.0))
    assert queues.next_deadline() == 4.0
    assert queues.expire(now=3.9) == []
    assert ids(queues.expire(now=6.0)) == [2, 3]
    assert len(queues) == 2
    assert queues.next_deadline() == 9.0


def test_next_deadline_skips_requests_that_already_left():
    queues = request_queues(1)
    fill(queues, (1, PAID, 0.0, 2.0), (2, PAID, 0.0, 5.0))
    queues.take(1, now=0.0)
    assert queues.next_deadline() == 5.0


def test_aged_free_requests_get_their_share_of_slots_under_paid_overload():
    queues = request_queues(2, age_limit=1.0, aged_share=0.1)
    fill(queues, *[(100 + i, FREE, 0.0) for i in range(10)])
    fill(queues, *[(i, PAID, 0.5) for i in range(100)])
    # at t=0.9 the free requests are not aged yet: paid takes everything
    assert ids(queues.take(10, now=0.9)) == list(range(10))
    # at t=1.0 they are: one slot in ten (the share) goes to the oldest aged free request
    assert ids(queues.take(10, now=1.0)) == [100, *range(10, 19)]


def test_aged_share_accrues_over_batches_of_one():
    queues = request_queues(2, age_limit=1.0, aged_share=0.25)
    fill(queues, (100, FREE, 0.0), (101, FREE, 0.0))
    fill(queues, *[(i, PAID, 0.0) for i in range(8)])
    taken = [ids(queues.take(1, now=2.0))[0] for _ in range(8)]
    assert taken == [0, 1, 2, 100, 3, 4, 5, 101]


def test_without_aging_paid_overload_starves_free():
    queues = request_queues(2)
    fill(queues, (100, FREE, 0.0))
    fill(queues, *[(i, PAID, 0.0) for i in range(20)])
    assert 100 not in ids(queues.take(10, now=60.0)) + ids(queues.take(10, now=60.0))


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"tiers": 0}, "tiers"), ({"tiers": 2, "aged_share": 1.5}, "aged_share")]
)
def test_bad_settings_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        request_queues(**kwargs)


class Stage(enum.Enum):
    WAITING = "waiting"
    SENT = "sent"
    GONE = "gone"


@dataclasses.dataclass(eq=False)
class Ticket:
    name: str
    tier: int
    arrival: float = 0.0
    deadline: float = math.inf
    state: Stage = Stage.WAITING
    tenant: str = ""


def test_the_queues_hold_anything_with_a_tier_a_tenant_times_and_a_state_in_its_own_states():
    queues = TierQueues(2, waiting=Stage.WAITING, taken=Stage.SENT)
    free, paid, late, gone = (Ticket("free", FREE), Ticket("paid", PAID), Ticket("late", FREE, deadline=1.0),
                              Ticket("gone", PAID))
    for ticket in (free, paid, late, gone):
        queues.push(ticket)
    gone.state = Stage.GONE
    queues.discard(gone)
    assert [t.name for t in queues.expire(now=2.0)] == ["late"] and len(queues) == 2
    late.state = Stage.GONE
    assert [t.name for t in queues.take(5, now=2.0)] == ["paid", "free"]
    assert (paid.state, free.state, len(queues)) == (Stage.SENT, Stage.SENT, 0)
    with pytest.raises(ValueError, match="cannot queue an item that is sent, not waiting"):
        queues.push(paid)
