"""The seat wait admission adds under a TPOT target (batcher.continuous.seat_wait), priced with
the SmolLM2 step costs the engines read: a decode step of 2 sequences of 300 tokens is 43 ms, of
3 is 49 ms, of 4 is 55 ms, so a 50 ms target seats 3 of them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batcher.continuous.seat_wait import Arrival, SeatBook, SeatedLoad, seat_wait
from batcher.continuous.token_load import TokenLoad
from batcher.core.admission import AdmissionControl
from workers.engine.fit import cost_fit

PRICE = cost_fit.load("experiments/step_costs/smollm2-135m-bf16-cpu.json").decode_seconds
TARGET = (0.050, 0.0)  # paid promises 50 ms, free nothing
MAX_SEQS = 16
LONG = 300  # each sequence's prompt and max_tokens


def held(*tenants: str, tier: int = 0, owed: int = 200) -> SeatBook:
    book = SeatBook()
    for tenant in tenants:
        book.sit(tier, tenant, LONG, owed)
    return book


def paid(tenant: str) -> Arrival:
    return Arrival(0, tenant, 1.0, LONG)


def test_with_no_target_the_seat_wait_is_none_and_the_estimate_is_todays() -> None:
    book = held(*["heavy"] * 12)
    assert seat_wait(book, paid("heavy"), (0.0, 0.0), MAX_SEQS, PRICE, 100.0, {}) == 0.0
    tokens = TokenLoad((900.0, 0.0), 1000.0, room=0.0)
    assert SeatedLoad(tokens, 0, 0.0).wait(0, 50) == tokens.wait(0, 50)


def test_a_free_seat_is_taken_at_once() -> None:
    assert seat_wait(held("heavy", "heavy"), paid("heavy"), TARGET, MAX_SEQS, PRICE, 40.0, {}) == 0.0
    assert seat_wait(SeatBook(), paid("heavy"), TARGET, MAX_SEQS, PRICE, 0.0, {}) == 0.0


def test_one_tenant_holding_every_seat_waits_about_one_sequences_remaining_decode() -> None:
    book = held("heavy", "heavy", "heavy", owed=200)  # 3 seats, each 200 tokens from its end
    rate = 3 / 0.049  # tokens/s: each of the 3 makes one per 49 ms step
    wait = seat_wait(book, paid("heavy"), TARGET, MAX_SEQS, PRICE, rate, {})
    assert abs(wait - 200 * 0.049) < 1e-9
    # not measured yet: the priced step stands in for the measured one
    assert abs(seat_wait(book, paid("heavy"), TARGET, MAX_SEQS, PRICE, 0.0, {}) - 200 * PRICE(3, 900)) < 1e-9


def test_max_seqs_is_a_seat_bound_too_under_a_target() -> None:
    book = held("heavy", "heavy", owed=100)
    assert seat_wait(book, paid("heavy"), TARGET, 2, PRICE, 20.0, {}) == 10.0


def test_a_light_tenant_beside_a_heavy_one_holding_every_seat_takes_its_share_at_once() -> None:
    book = held("heavy", "heavy", "heavy")
    assert seat_wait(book, paid("light"), TARGET, MAX_SEQS, PRICE, 60.0, {}) == 0.0
    # ... up to its share: holding 1 of the 3 seats, heavy's (2 - 1) / 1 < light's (1 + 1) / 1
    book = held("heavy", "heavy", "light")
    assert seat_wait(book, paid("light"), TARGET, MAX_SEQS, PRICE, 60.0, {}) > 0
    # a weight buys a larger share: (1 + 1) / 2 <= 1
    assert seat_wait(book, Arrival(0, "light", 2.0, LONG), TARGET, MAX_SEQS, PRICE, 60.0, {}) == 0.0


def test_a_lower_tiers_seat_is_taken_and_a_higher_tiers_is_not() -> None:
    free = held("a", "b", "c", tier=1)
    assert seat_wait(free, paid("heavy"), TARGET, MAX_SEQS, PRICE, 60.0, {}) == 0.0
    book = held("a", "b", "c")
    assert seat_wait(book, Arrival(1, "x", 1.0, LONG), TARGET, MAX_SEQS, PRICE, 60.0, {}) > 0


def test_admission_sheds_the_heavy_tenants_request_with_its_seat_wait_and_admits_the_light_one() -> None:
    admission = AdmissionControl((0.5, 5.0))
    tokens = TokenLoad((0.0, 0.0), 1000.0, room=4000.0)  # no prompt backlog at all
    book = held("heavy", "heavy", "heavy")
    heavy = seat_wait(book, paid("heavy"), TARGET, MAX_SEQS, PRICE, 60.0, {})
    light = seat_wait(book, paid("light"), TARGET, MAX_SEQS, PRICE, 60.0, {})
    shed = admission.shed(SeatedLoad(tokens, 0, heavy), 0, 0.0, 500, "heavy")
    assert shed is not None and heavy == 10.0
    assert admission.shed(SeatedLoad(tokens, 0, light), 0, 0.0, 500, "light") is None


@given(st.integers(1, 40), st.integers(0, 5000), st.integers(0, 40), st.integers(0, 5000),
       st.floats(0.0, 500.0))
def test_the_seat_wait_grows_with_load(seqs: int, owed: int, more: int, more_owed: int, rate: float) -> None:
    book = SeatBook()
    for _ in range(seqs):
        book.sit(0, "heavy", LONG, owed // seqs)
    before = seat_wait(book, paid("heavy"), TARGET, MAX_SEQS, PRICE, rate, {})
    for _ in range(more):
        book.sit(0, "heavy", LONG, more_owed // max(more, 1))
    if more and rate == 0:  # unmeasured it is the mean held sequence's remaining decode: short ones lower it
        return
    assert seat_wait(book, paid("heavy"), TARGET, MAX_SEQS, PRICE, rate, {}) >= before


def test_an_estimate_costs_a_look_per_tenant_not_per_sequence() -> None:
    calls = []

    def price(seqs: int, context: int) -> float:
        calls.append(seqs)
        return PRICE(seqs, context)

    for count in (4, 4000):
        book = held(*["heavy"] * count)
        calls.clear()
        seat_wait(book, paid("light"), TARGET, MAX_SEQS, price, 60.0, {})
        assert len(calls) == 1
        assert book.tenants == {0: {"heavy": count}}


def test_the_book_forgets_what_left() -> None:
    book = held("heavy", "light")
    book.leave(0, "heavy", LONG, 200)
    book.leave(0, "light", LONG, 200)
    assert (book.held, book.context, book.owed, book.tiers, book.tenants) == (0, 0, 0, {}, {})
