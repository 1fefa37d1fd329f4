"""``python -m workers engine --simulated ...`` as a real process over real pipes: requests in,
tokens, finished frames and stats out; aborts; EOF; protocol faults; a parent that dies. And
``--model DIR`` with a tiny real checkpoint: its token frames are the engine's own answers.

The simulated 70B prices each step at 5 ms or more (its weight read on 8 x H100), so sequences
stay running long enough to be aborted mid-answer. The real clock runs these tests; bounds are
generous and nothing asserts speed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys

import msgspec
import pytest
import trio

from tests.support.processes import alive
from tests.support.waiting import until_trio
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.loop import STOPS
from workers.engine.runner import ModelRunner
from workers.protocol import (
    Abort,
    Add,
    EngineStats,
    FrameDecoder,
    Message,
    Ready,
    RunBatch,
    SequenceFinished,
    Tokens,
    encode,
)
from workers.sampling import Sampling

ENGINE = [
    "engine",
    "--simulated",
    "llama-70b",
    "--num-blocks",
    "64",
    "--max-batch-tokens",
    "64",
    "--max-seqs",
    "16",
]


def add(rid: int, prompt_len: int, max_tokens: int, tier: int = 0) -> Add:
    prompt = [(rid * 31 + i) % 1000 + 3 for i in range(prompt_len)]
    return Add(rid, prompt, max_tokens, tier, "acme", 0.0, 1.0, 0, None, [], False)


class EngineProcess:
    """The pool's side of one engine worker, for a test: send frames, read until a condition."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.decoder = FrameDecoder()
        self.received: list[Message] = []

    async def send(self, *messages: Message) -> None:
        await self.process.stdin.send_all(b"".join(encode(m) for m in messages))

    async def until(self, done, seconds: float = 30.0) -> list[Message]:
        """Read frames until ``done(received)`` holds; returns every frame received so far."""
        with trio.fail_after(seconds):
            while not done(self.received):
                data = await self.process.stdout.receive_some(1 << 16)
                assert data, f"engine worker exited with {await self.process.wait()}"
                self.received += self.decoder.feed(data)
        return self.received

    def of(self, kind: type) -> list:
        return [m for m in self.received if isinstance(m, kind)]


@contextlib.asynccontextmanager
async def engine_process(args: list[str]):
    """A started engine worker, once it has sent ``ready`` and its first ``stats``."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "workers", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    worker = EngineProcess(process)
    try:
        await worker.until(lambda got: any(isinstance(m, EngineStats) for m in got), seconds=60)
        yield worker
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.fixture
async def engine():
    async with engine_process(ENGINE) as worker:
        yield worker


async def test_the_worker_announces_itself_then_its_empty_cache(engine):
    ready, stats = engine.received[:2]
    assert isinstance(ready, Ready) and ready.model == "sim-llama-70b" and ready.pid == engine.process.pid
    assert (stats.total_blocks, stats.free_blocks, stats.used_blocks, stats.running, stats.waiting) == (
        64,
        64,
        0,
        0,
        0,
    )


async def test_fifty_requests_stream_their_tokens_and_finish_with_their_usage_or_aborted(engine):
    aborted = set(range(0, 50, 5))  # these would run for a minute; the rest ask for 20-39 tokens
    requests = [
        add(rid, 10 + 7 * rid % 90, 10_000 if rid in aborted else 20 + rid % 20, tier=rid % 2)
        for rid in range(50)
    ]
    await engine.send(*requests)
    await engine.until(lambda got: any(isinstance(m, Tokens) for m in got))
    await engine.send(*(Abort(rid) for rid in sorted(aborted)))
    got = await engine.until(lambda got: len([m for m in got if isinstance(m, SequenceFinished)]) == 50)
    finished = {m.rid: m for m in engine.of(SequenceFinished)}
    for request in requests:
        ids = [i for m in engine.of(Tokens) if m.rid == request.rid for i in m.ids]
        done = finished[request.rid]
        if request.rid in aborted:
            assert done.reason == "aborted" and len(ids) == done.usage.output_tokens < 100
        else:
            assert done.reason == "max_tokens" and len(ids) == request.max_tokens == done.usage.output_tokens
        assert done.usage.prompt_tokens == len(request.prompt_tokens)
        tokens_at = [i for i, m in enumerate(got) if isinstance(m, Tokens) and m.rid == request.rid]
        assert all(at < got.index(done) for at in tokens_at)  # its last token before its end
    ended = len(got)
    await engine.until(lambda got: any(isinstance(m, EngineStats) for m in got[ended:]))
    after = next(m for m in engine.received[ended:] if isinstance(m, EngineStats))
    assert (after.running, after.waiting, after.used_blocks, after.free_blocks) == (0, 0, 0, 64)
    assert after.generated_tokens == sum(m.usage.output_tokens for m in finished.values())
    assert after.preemptions > 0  # 16 running sequences want more than 64 blocks: some recompute


async def test_aborted_requests_finish_as_aborted_and_their_blocks_are_free_by_the_next_stats(engine):
    long = [add(rid, 40, 10_000) for rid in range(3)]  # would run for a minute
    await engine.send(*long, add(3, 20, 5))
    await engine.until(lambda got: {m.rid for m in got if isinstance(m, Tokens)} >= {0, 1, 2, 3})
    await engine.send(Abort(0), Abort(1), Abort(2), Abort(999))  # 999: unknown, ignored
    await engine.until(lambda got: {m.rid for m in got if isinstance(m, SequenceFinished)} == {0, 1, 2, 3})
    reasons = {m.rid: m.reason for m in engine.of(SequenceFinished)}
    assert reasons == {0: "aborted", 1: "aborted", 2: "aborted", 3: "max_tokens"}
    seen = len(engine.received)
    await engine.until(lambda got: any(isinstance(m, EngineStats) for m in got[seen:]))
    after = next(m for m in engine.received[seen:] if isinstance(m, EngineStats))
    assert (after.used_blocks, after.running, after.free_blocks) == (0, 0, 64)
    assert [m for m in engine.received[seen:] if isinstance(m, Tokens | SequenceFinished)] == []


async def test_eof_on_its_input_ends_the_worker_cleanly(engine):
    await engine.send(add(0, 30, 10_000))
    await engine.until(lambda got: any(isinstance(m, Tokens) for m in got))
    await engine.process.stdin.aclose()
    with trio.fail_after(20):
        assert await engine.process.wait() == 0


@pytest.mark.parametrize(
    "frames",
    [
        b"\x00\x00\x00\x01\xc1",  # not msgpack
        encode(RunBatch(1, ["a fixed-mode call"])),  # a kind the engine does not take
        encode(add(5, 10, 3)) + encode(add(5, 10, 3)),  # a rid already live
        encode(Add(6, [], 3, 0, "", 0.0, 1.0, 0, None, [], False)),  # an empty prompt
    ],
    ids=["garbage", "wrong-kind", "duplicate-rid", "empty-prompt"],
)
async def test_a_frame_that_breaks_the_protocol_exits_non_zero(engine, frames, capfd):
    await engine.process.stdin.send_all(frames)
    with trio.fail_after(20):
        assert await engine.process.wait() == 2
    assert "protocol fault" in capfd.readouterr().err


async def test_an_engine_worker_exits_when_its_parent_dies_even_with_its_pipes_open(tmp_path):
    pid_file = tmp_path / "pids"
    parent = (  # the pipes' other ends live on in `sleep`: no EOF, no broken pipe, only the watchdog
        "import os, subprocess, sys\n"
        "r_in, w_in = os.pipe(); r_out, w_out = os.pipe()\n"
        "holder = subprocess.Popen(['sleep', '120'], pass_fds=[w_in, r_out])\n"
        f"worker = subprocess.Popen([sys.executable, '-m', 'workers', *{ENGINE!r}],\n"
        "                          stdin=r_in, stdout=w_out)\n"
        "os.read(r_out, 1)\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{worker.pid}} {{holder.pid}}')\n"
    )
    await trio.run_process([sys.executable, "-c", parent])
    worker_pid, holder_pid = map(int, pid_file.read_text().split())
    try:
        await until_trio(lambda: not alive(worker_pid), "the orphaned engine worker's exit", within=10)
    finally:
        os.kill(holder_pid, signal.SIGTERM)


MODEL_ENGINE = ["--block-size", "4", "--num-blocks", "512", "--max-batch-tokens", "32", "--max-seqs", "8"]


def in_process(model_dir, requests: list[Add]) -> dict[int, list[int]]:
    """Each request's answer from an engine in this process, set up as the worker is: the ids it
    generated, less the stop token of one that a stop token ended."""
    runner = ModelRunner(model_dir, block_size=4, num_blocks=512)
    engine = Engine(runner, EngineConfig(4, 512, max_batch_tokens=32, max_seqs=8))
    answers: dict[int, list[int]] = {}
    for r in requests:
        sampling = Sampling(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos,
                                  stop_token_ids=tuple(r.stop_token_ids))
        answers[engine.add(r.prompt_tokens, sampling, tier=r.tier, tenant=r.tenant, rid=r.rid)] = []
    while engine.has_work:
        output = engine.step()
        for rid, token in output.tokens.items():
            answers[rid].append(token)
        for done in output.finished:
            if done.reason in STOPS:
                answers[done.rid].pop()
    return answers


async def test_the_real_model_s_token_frames_are_the_engine_s_answers_and_aborts_free_their_blocks(
    tiny_checkpoints,
):
    model_dir = tiny_checkpoints["long-context"]  # a context of 8,192: the long answers run for seconds
    rng = random.Random(4)

    def request(rid: int, max_tokens: int) -> Add:
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(3, 60))]
        return Add(rid, prompt, max_tokens, rid % 2, "acme", 0.0, 1.0, 0, None, [], max_tokens > 100)

    short = [request(rid, rng.randint(1, 30)) for rid in range(12)]
    long = [request(rid, 8000) for rid in range(12, 15)]
    async with engine_process(["engine", "--model", str(model_dir), *MODEL_ENGINE]) as worker:
        assert worker.received[0].model == "long-context"
        await worker.send(*long, *short)
        await worker.until(lambda got: {m.rid for m in got if isinstance(m, Tokens)} >= {12, 13, 14})
        await worker.send(*(Abort(r.rid) for r in long))
        ended = await worker.until(lambda got: len([m for m in got if isinstance(m, SequenceFinished)]) == 15)
        seen = len(ended)
        await worker.until(lambda got: any(isinstance(m, EngineStats) for m in got[seen:]))
    after = next(m for m in worker.received[seen:] if isinstance(m, EngineStats))
    assert (after.used_blocks, after.free_blocks, after.running, after.waiting) == (0, 512, 0, 0)
    streamed = {r.rid: [i for m in worker.of(Tokens) if m.rid == r.rid for i in m.ids] for r in long + short}
    reasons = {m.rid: m.reason for m in worker.of(SequenceFinished)}
    assert {reasons[r.rid] for r in long} == {"aborted"}
    assert all(0 < len(streamed[r.rid]) < 8000 for r in long)
    # The worker's answers are the in-process engine's, aborted ones cut where they stopped.
    cut = [msgspec.structs.replace(r, max_tokens=len(streamed[r.rid])) for r in long]
    assert streamed == in_process(model_dir, cut + short)
    assert all(len(streamed[r.rid]) == r.max_tokens or reasons[r.rid] == "eos" for r in short)


async def test_a_sequence_ended_by_a_stop_token_is_billed_for_it_but_not_sent_it(tiny_checkpoints):
    model_dir = tiny_checkpoints["long-context"]
    rng = random.Random(7)
    plain = [Add(rid, [rng.randrange(3, 384) for _ in range(rng.randint(3, 30))], 24, 0, "acme", 0.0, 1.0, 0,
                 None, [], True) for rid in range(8)]
    answers = in_process(model_dir, plain)
    # each request stops at the id its answer makes fifth
    requests = [msgspec.structs.replace(r, stop_token_ids=[answers[r.rid][4]]) for r in plain]
    async with engine_process(["engine", "--model", str(model_dir), *MODEL_ENGINE]) as worker:
        await worker.send(*requests)
        await worker.until(lambda got: len([m for m in got if isinstance(m, SequenceFinished)]) == 8)
    streamed = {r.rid: [i for m in worker.of(Tokens) if m.rid == r.rid for i in m.ids] for r in requests}
    finished = {m.rid: m for m in worker.of(SequenceFinished)}
    assert {m.reason for m in finished.values()} == {"stop_token"}
    for r in requests:
        stop = answers[r.rid].index(r.stop_token_ids[0])
        assert streamed[r.rid] == answers[r.rid][:stop]  # everything before the stop id, not it
        assert finished[r.rid].usage.output_tokens == stop + 1
