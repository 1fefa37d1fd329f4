"""What vLLM's adapter expects vLLM's next step to compute, announced before it runs: new
sequences their whole prompt, running ones a token each, the step within vLLM's token budget."""

from __future__ import annotations

import pytest

from workers.vllm_step import Live, step_lengths


def running(prompt: int, shown: int) -> Live:
    return Live(prompt, frozenset(), shown=shown, cached=prompt // 2)


def test_running_sequences_decode_a_token_each_and_new_ones_prefill_their_whole_prompt():
    live = [running(100, 3), Live(500, frozenset()), running(40, 1), Live(200, frozenset())]
    queries, contexts = step_lengths(live, budget=2048)
    assert queries == [1, 1, 500, 200]
    assert contexts == [103, 41, 500, 200]


def test_a_prompt_longer_than_the_budget_is_one_budget_s_chunk_after_the_decodes():
    live = [Live(5000, frozenset()), running(100, 7), running(100, 2)]
    queries, _ = step_lengths(live, budget=2048)
    assert queries == [1, 1, 2046]


def test_the_prefills_of_a_step_share_what_the_decodes_leave_of_the_budget_in_arrival_order():
    live = [running(10, 1), Live(1500, frozenset()), Live(1500, frozenset()), Live(30, frozenset())]
    queries, contexts = step_lengths(live, budget=2048)
    assert queries == [1, 1500, 547]  # the third prompt waits for a later step
    assert contexts == [11, 1500, 547]
    assert sum(queries) == 2048


def test_decodes_past_the_budget_are_not_counted_and_a_budget_below_one_is_refused():
    assert step_lengths([running(10, 1)] * 5, budget=3) == ([1, 1, 1], [11, 11, 11])
    assert step_lengths([], budget=8) == ([], [])
    with pytest.raises(ValueError, match="budget"):
        step_lengths([running(10, 1)], budget=0)
