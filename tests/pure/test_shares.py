"""FairQueue's properties: one tenant is FIFO, shares converge to weights, nobody starves, a
tenant back from idle banks no credit, and what `ahead` says is what `pop` does."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.shares import FairQueue


@dataclasses.dataclass(eq=False)
class Item:
    tenant: str
    n: int
    cost: float = 1.0
    waiting: bool = True


def queue(weights=None, cost=False):
    return FairQueue(weights or {}, lambda i: i.tenant, lambda i: i.waiting,
                     (lambda i: i.cost) if cost else None)


def drain(q, n=None):
    out = []
    while len(q) and (n is None or len(out) < n):
        item = q.pop()
        item.waiting = False
        out.append(item)
    return out


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 50)), max_size=60))
def test_a_single_tenant_is_served_first_in_first_out_whatever_it_costs_and_whoever_leaves(ops):
    q, pushed, taken = queue(cost=True), [], []
    for n, (push, cost) in enumerate(ops):
        if push or not len(q):
            item = Item("solo", n, cost)
            q.push(item)
            pushed.append(item)
        elif cost % 3 == 0:  # one leaves (cancelled) from the middle
            gone = next(i for i in reversed(pushed) if i.waiting)
            gone.waiting = False
            q.forget(gone)
        else:
            item = q.pop()
            item.waiting = False
            taken.append(item)
    taken += drain(q)
    served = [i for i in pushed if i in taken]
    assert taken == served  # arrival order, nobody skipped
    assert len(q) == 0 and q.ahead("solo") == 0


@settings(max_examples=50)
@given(st.dictionaries(st.sampled_from("abcd"), st.integers(1, 5), min_size=2), st.integers(10, 50))
def test_under_backlog_each_tenant_is_served_in_proportion_to_its_weight(weights, cycles):
    q = queue(weights)
    total = sum(weights.values())
    rounds = cycles * total
    for k in range(rounds):  # every tenant has more than it can be given
        for tenant in weights:
            q.push(Item(tenant, k))
    counts = {t: 0 for t in weights}
    for item in drain(q, rounds):
        counts[item.tenant] += 1
    for tenant, weight in weights.items():
        assert abs(counts[tenant] - rounds * weight / total) <= 1


@settings(max_examples=50)
@given(st.integers(1, 30), st.integers(1, 2000))
def test_a_light_tenant_beside_a_heavy_backlog_waits_for_at_most_one_of_its_items(light_costs, heavy):
    """The light tenant's item is taken within the next two pops however much the heavy one
    queued, and `ahead` said so beforehand."""
    q = queue(cost=True)
    for k in range(heavy):
        q.push(Item("heavy", k, cost=light_costs))
    drain(q, min(heavy - 1, 5))
    predicted = q.ahead("light")
    q.push(Item("light", 0, cost=1.0))
    taken = drain(q, 2)
    assert "light" in [i.tenant for i in taken]
    assert predicted <= light_costs


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=200), st.integers(0, 5))
def test_no_tenant_starves_every_waiting_tenant_is_served_within_a_round(arrivals, between):
    q = queue()
    for n, tenant in enumerate(arrivals):
        q.push(Item(tenant, n))
    waiting = {i.tenant for i in q}
    taken = [i.tenant for i in drain(q, len(waiting))]
    assert set(taken) == waiting


def test_a_tenant_back_from_idle_banks_no_credit_for_the_time_it_sent_nothing():
    q = queue()
    for k in range(100):
        q.push(Item("a", k))
        q.push(Item("b", k))
    drain(q, 100)  # a and b alternate; c sent nothing all this time
    for k in range(10):
        q.push(Item("c", k))
    taken = [i.tenant for i in drain(q, 12)]
    assert taken.count("c") <= 5  # a third of the service from now on, not everything until it catches up


def test_ahead_of_a_heavy_tenant_is_its_own_backlog_and_the_others_share_of_it():
    q = queue()
    for k in range(40):
        q.push(Item("heavy", k))
    for k in range(3):
        q.push(Item("light", k))
    assert q.ahead("heavy") == 40 + 3  # its own 40, and light's 3 all go before its new one
    assert q.ahead("light") == 3 + 4  # its own 3, and heavy's turn for each of them and its own
    assert q.ahead("new") == 2  # one of each before a tenant new to the tier
