"""The serving loop every engine runs, without its shells: frames in, a step's frames out, stats
on time, how long a read may wait (a hand-off midway is read to its end before a step), and
what breaks the protocol."""

from __future__ import annotations

import pytest

from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS
from workers.engine.engine import Engine
from workers.engine.kv_transfer import KvTransfer
from workers.engine.loop import HANDOFF_READ_WAIT, STATS_INTERVAL, EngineLoop, step_messages
from workers.engine.simulated import SimulatedRunner
from workers.protocol import (
    Abort,
    Add,
    EngineStats,
    KvBlocks,
    ProtocolError,
    Ready,
    SequenceFinished,
    StepBegun,
    Tokens,
)
from workers.sampling import Sampling

EOS = 2


def loop_at(now: float) -> EngineLoop:
    runner = SimulatedRunner(PRESETS["smollm2-135m"], num_blocks=64, eos_token_id=EOS)
    return EngineLoop(Engine(runner, EngineConfig(num_blocks=64)), now)


def add(rid: int, max_tokens: int, **sampling) -> Add:
    return Add.of(rid, [5, 6, 7], 0, "acme", Sampling(max_tokens, temperature=0.0, **sampling))


def test_an_added_sequence_streams_a_token_a_step_and_ends_with_its_usage():
    loop = loop_at(0.0)
    loop.take([add(7, 3)])
    frames = [step_messages(loop.step()) for _ in range(3)]
    assert [type(f) for step in frames for f in step] == [Tokens, Tokens, Tokens, SequenceFinished]
    end = frames[-1][-1]
    assert (end.rid, end.reason, end.usage.prompt_tokens, end.usage.output_tokens) == (7, "max_tokens", 3, 3)
    assert loop.step() is None  # idle: it waits for a frame or the next stats


def test_stats_are_due_at_once_then_every_interval():
    loop = loop_at(10.0)
    assert isinstance(loop.stats(10.0), EngineStats)
    assert loop.stats(10.0 + STATS_INTERVAL / 2) is None
    assert loop.stats(10.0 + STATS_INTERVAL) is not None
    assert loop.next_stats == pytest.approx(10.0 + 2 * STATS_INTERVAL)


def test_a_step_announced_as_long_is_followed_by_stats_however_recent_the_last():
    loop = loop_at(10.0)
    assert isinstance(loop.stats(10.0), EngineStats)
    assert loop.announce(2.5) == StepBegun(seconds=2.5)
    assert isinstance(loop.stats(10.0 + STATS_INTERVAL / 2), EngineStats)  # the pool's limit is reset
    assert loop.stats(10.0 + STATS_INTERVAL) is None  # and the interval runs from there


def test_an_abort_ends_its_sequence_at_the_next_step_and_an_unknown_one_is_ignored():
    loop = loop_at(0.0)
    loop.take([add(1, 50), Abort(rid=99)])
    loop.step()
    loop.take([Abort(rid=1)])
    (end,) = step_messages(loop.step())
    assert (end.rid, end.reason, end.usage.output_tokens) == (1, "aborted", 1)


class Cache:
    """A KV cache's sizes, for a hand-off's bookkeeping (no bytes are imported here)."""

    block_size, num_blocks, block_bytes = 16, 64, 64


def test_a_read_waits_for_a_hand_off_midway_and_else_only_while_the_engine_is_idle():
    loop = loop_at(0.0)
    loop.handoffs = KvTransfer(loop.engine, Cache(), prefill=False)  # type: ignore[arg-type]
    loop.stats(0.0)
    assert loop.read_wait(0.05, pending=0) == pytest.approx(STATS_INTERVAL - 0.05)  # idle: until stats
    loop.take([add(1, 50)])
    assert loop.read_wait(0.0, pending=0) == 0.0  # busy: what has arrived, then the step
    assert loop.read_wait(0.0, pending=10) == HANDOFF_READ_WAIT  # a frame part-read: its rest comes
    loop.take([KvBlocks(2, bytes(64))])
    assert loop.read_wait(0.0, pending=0, more=True) == HANDOFF_READ_WAIT  # kv frames, no kv_handoff yet


@pytest.mark.parametrize(
    ("frame", "complaint"),
    [
        (Ready(pid=1, model="m"), "unexpected ready frame"),
        (Add(3, [], 5, 0, "", 0.0, 1.0, 0, None, [], False), "add 3 refused: .*prompt"),
        (Add(4, [1], 0, 0, "", 0.0, 1.0, 0, None, [], False), "add 4 refused: max_tokens"),
    ],
)
def test_a_frame_the_loop_cannot_take_breaks_the_protocol_naming_why(frame, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        loop_at(0.0).take([frame])
