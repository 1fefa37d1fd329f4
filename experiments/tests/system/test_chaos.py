"""The chaos suite in its short form (seconds a row, fixed seeds): real gateways, real workers,
faults under load, every answer checked; and its checks on hand-made answers, so a check that
could not fail would show here."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from experiments.chaos.__main__ import run
from experiments.chaos.checks import Rules, judge, mirror
from experiments.chaos.scenarios import BY_NAME, SHORT, SHORT_PARAMS
from experiments.chaos.traffic import Shot
from gateway.accounting.usage import UsageRecord


@pytest.mark.parametrize("name", SHORT)
def test_a_fault_under_load_loses_nothing_and_answers_as_documented(name, tmp_path: pathlib.Path):
    verdict = asyncio.run(run(BY_NAME[name], SHORT_PARAMS, tmp_path))
    assert verdict.sent > 0 and verdict.lost == 0 and verdict.duplicated == 0
    assert verdict.violations == []
    if name not in ("crash-on-first-call", "sigterm"):
        assert verdict.succeeded > 0.8 * (verdict.sent - verdict.gave_up)


def answered(index: int, output: str, status: int = 200, request_id: str | None = None, **fields) -> Shot:
    shot = Shot(index, "paid", False, f"chaos {index:06d} x", scheduled=0.0, status=status,
                request_id=request_id or f"msg_{index}", finished=0.1, **fields)
    if status == 200:
        shot.output = output
    return shot


def record(request_id: str, status: int = 200) -> UsageRecord:
    return UsageRecord(request_id, 0.0, "t", "k", "m@1", 1, 1, 0.01, 0.1, status, "end_turn", "completed")


def test_the_checks_catch_cross_talk_missing_usage_leaky_errors_and_duplicates():
    good = answered(0, "")
    good.output = mirror(good)
    crossed = answered(1, mirror(good))  # request 1 got request 0's answer
    unbilled = answered(2, "")
    unbilled.output = mirror(unbilled)
    leaky = answered(
        3, "", status=500, body={"type": "error", "error": {"type": "api_error", "message": "pid 42 died"}}
    )
    no_retry = answered(
        4, "", status=529, body={"type": "error", "error": {"type": "overloaded_error", "message": "x"}}
    )
    twice = answered(5, "", request_id="msg_0")
    twice.output = mirror(twice)
    lost = Shot(6, "free", True, "chaos 000006 x", scheduled=0.0, failure="ServerDisconnectedError")
    usage = [record("msg_0"), record("msg_1"), record("msg_3", 500), record("msg_4", 529)]
    verdict = judge("hand-made", [good, crossed, unbilled, leaky, no_retry, twice, lost],
                    usage, Rules(statuses=frozenset({500, 529})))
    problems = "\n".join(verdict.violations)
    assert (verdict.sent, verdict.succeeded, verdict.lost, verdict.duplicated) == (7, 3, 1, 1)
    for expected in ("request 1 (whole, paid): answered", "request 2: no usage record",
                     "request 3 (whole, paid): an error message names internals",
                     "request 4 (whole, paid): a 529 without Retry-After", "request 6 got no answer"):
        assert expected in problems


def test_a_stream_error_event_is_documented_only_with_its_status():
    shot = Shot(
        0,
        "free",
        True,
        "chaos 000000 x",
        scheduled=0.0,
        status=200,
        request_id="msg_0",
        finished=0.1,
        events=[
            ("message_start", {}),
            ("ping", {}),
            ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "late"}}),
        ],
    )
    usage = [record("msg_0")]
    assert judge("documented", [shot], usage, Rules(statuses=frozenset({529}))).documented == {
        "529 in stream": 1
    }
    assert judge("not", [shot], usage, Rules(statuses=frozenset({500}))).violations != []
