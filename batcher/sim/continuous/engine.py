"""An engine worker inside the gateway's trio run: the real engine and loop over a priced runner.

:class:`SimulatedEngine` is what the :class:`~batcher.continuous.pool.EnginePool`'s spawn gives in
place of an :class:`~batcher.continuous.engine_process.EngineProcess`, with its surface. Inside,
the production :class:`~workers.engine.loop.EngineLoop` drives the production
:class:`~workers.engine.engine.Engine` over a :class:`~workers.engine.simulated.SimulatedRunner`
under trio's clock: a step's price passes as a ``trio.sleep_until``, while the pool reads (the
loop runs inside :meth:`receive`). Faults: :meth:`kill`, :meth:`freeze`, :meth:`stall`,
:meth:`hold_output`.
With ``jump`` (the replay's) a run of decode steps is waited out at once
(:mod:`batcher.sim.continuous.plan`), then taken as real steps, and a sequence's tokens go out
at its first token and its end; :meth:`unread` counts the rest for :class:`ReadAhead`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.router import Route, Router
from batcher.sim.continuous.plan import Plan, plan
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS, CostModel
from workers.engine.engine import Engine
from workers.engine.interface import StepOutput
from workers.engine.loop import STOPS, EngineLoop, finished_message, step_messages
from workers.engine.simulated import SimulatedRunner
from workers.protocol import (
    EngineStats,
    FrameDecoder,
    Message,
    ProtocolError,
    SequenceFinished,
    StepBegun,
    Tokens,
    WorkerLost,
)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpec:
    """What every simulated engine of a model is: its step prices, its engine settings, and its
    tokens (``vocab`` ids at most, 128 for ASCII; an end-of-sequence with ``eos_prob``)."""

    cost: CostModel
    engine: EngineConfig
    eos_prob: float = 0.0
    vocab: int | None = None

    @classmethod
    def of(
        cls, model: ContinuousModelConfig, cost: CostModel | None = None, eos_prob: float = 0.0
    ) -> EngineSpec:
        """The engines a worker process would run for ``model`` (its ``simulated`` preset's
        prices unless ``cost`` is given), sized by its ``num_blocks`` or ``kv_memory_gb``."""
        cost = PRESETS[model.simulated or "llama-70b"] if cost is None else cost
        runner = SimulatedRunner(
            cost,
            block_size=model.block_size,
            num_blocks=model.num_blocks or None,
            kv_memory_gb=model.kv_memory_gb or None,
        )
        engine = EngineConfig(
            block_size=model.block_size,
            num_blocks=runner.num_blocks,
            max_batch_tokens=model.max_batch_tokens,
            max_seqs=model.max_seqs,
            model_version=model.name,
        )
        return cls(cost, engine, eos_prob, 128 if model.tokenizer == "bytes" else None)

    def runner(self) -> SimulatedRunner:
        config = self.engine
        return SimulatedRunner(
            self.cost,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            eos_prob=self.eos_prob,
            vocab=self.vocab,
        )


@dataclasses.dataclass(slots=True)
class _Taken:
    """Steps the engine has taken whose time has not yet passed: their outputs, and the part of
    a planned run they are."""

    end: float
    outputs: list[StepOutput]
    plan: Plan | None = None


class SimulatedEngine:
    """One simulated engine worker (see the module doc); ``name`` says which slot and start."""

    pid: int | None = None
    placement = "local"  # it runs inside this process

    def __init__(self, spec: EngineSpec, name: str, jump: bool = False, start_s: float = 0.0) -> None:
        self.name = name
        self.jump = jump
        self.start_s = start_s  # seconds from spawn to ready (loading weights)
        self.leapt = 0  # steps taken inside runs of decode steps beyond the first of each
        self.cut = 0  # runs that work or a look reached before their planned end
        self.runner = spec.runner()
        self._begun: float | None = None  # when the step of a run being taken began
        self.engine = Engine(self.runner, spec.engine, clock=self._clock, cost=spec.cost)
        self.loop = EngineLoop(self.engine, trio.current_time())
        self.first_stats: EngineStats
        self.frozen = False
        self._last_words: list[Message] = []  # frames a stalled engine sends before its silence
        self._stalled_until = -math.inf
        self._decoder = FrameDecoder()
        self._inbox: list[Message] = []
        self._arrived = trio.Event()
        self._outbox: list[Message] = []
        self._step: _Taken | None = None  # steps taken, their time not yet passed
        self._plan: Plan | None = None  # a run planned, none of it taken yet
        self._unsent: dict[int, list[int]] = {}  # rid -> ids not handed out, once its first is
        self._unread = 0  # ids in _unsent
        self.reported_at = 0.0  # when it last sent stats (the pool kills an engine silent too long)
        self._held_until = -math.inf
        self._exited = trio.Event()
        self._reading = trio.CancelScope()

    async def start(self) -> None:
        await trio.sleep(self.start_s)
        self.reported_at = trio.current_time()
        first = self.loop.stats(self.reported_at)
        assert first is not None, "the loop reports at once"
        self.first_stats = first

    async def send(self, data: bytes) -> None:
        """Frames for the engine's next turn; raises WorkerLost once it has exited."""
        await trio.lowlevel.checkpoint()
        if self._exited.is_set():
            raise WorkerLost(f"simulated engine {self.name}: pipe closed")
        self.catch_up()
        self._inbox += self._decoder.feed(data)
        self._arrived.set()

    async def receive(self) -> list[Message]:
        """Run the engine until it has frames and the pool may read them; return them all."""
        while not self._exited.is_set():
            with trio.CancelScope() as self._reading:
                if self._last_words:
                    frames, self._last_words = self._last_words, []
                    return frames
                if self.frozen:
                    await trio.sleep_forever()
                if self._stalled_until > trio.current_time():
                    await trio.sleep_until(self._stalled_until)
                try:
                    return await self._run()
                except ProtocolError:
                    self._exited.set()  # a worker process exits on a frame it refuses
                    raise
        raise WorkerLost(f"simulated engine {self.name} was killed")

    async def wait_exit(self) -> None:
        await self._exited.wait()

    async def stop(self, grace: float = 0.0) -> None:
        self.kill()
        await trio.lowlevel.checkpoint()

    def kill(self) -> None:
        """Exit now, like a SIGKILL: what it computed and did not hand out is lost."""
        self._exited.set()
        self._reading.cancel()

    def freeze(self) -> None:
        """Stop, like a SIGSTOP: alive, but no step and no frame from now on."""
        self.frozen = True
        self._reading.cancel()

    def stall(self, expected: float, seconds: float = math.inf) -> None:
        """Announce a step of ``expected`` seconds and spend ``seconds`` in it before it goes on
        (inf: hang in it), like a worker in a step it announced as long: its ``step`` frame, then
        no frame for ``seconds``."""
        self._last_words = [StepBegun(seconds=expected)]
        self._stalled_until = trio.current_time() + seconds
        self._reading.cancel()

    def hold_output(self, seconds: float) -> None:
        """Nobody reads for ``seconds``: the engine runs on and its frames wait to be read."""
        self._held_until = trio.current_time() + seconds

    def catch_up(self) -> None:
        """Bring a planned run to now, where a step-by-step engine would be: the steps ended by
        now and the one under way taken, the rest never. Whatever acts on the engine or reads
        its state from outside calls this first."""
        planned, self._plan = self._plan, None
        if planned is None:
            return
        ends = planned.ends
        steps = min(len(ends), bisect.bisect_right(ends, trio.current_time()) + 1)
        self.cut += steps < len(ends)
        self.leapt += steps - 1
        outputs = []
        for begun in (planned.start, *ends[: steps - 1]):
            self._begun = begun  # the engine's clock reads when each step began
            outputs.append(self.engine.step())
        self._begun = None
        self._step = _Taken(ends[steps - 1], outputs, Plan(planned.start, ends[:steps], planned.seqs))
        self._arrived.set()  # the loop waits out the run's new end

    def _clock(self) -> float:
        """The engine's clock: now, or the time the step of a run being taken began."""
        return trio.current_time() if self._begun is None else self._begun

    def unread(self) -> int:
        """Tokens its steps have made by now that the pool has not been handed (see the module
        doc): what the pool's view of this replica's load lacks."""
        planned = self._plan or (self._step.plan if self._step is not None else None)
        if planned is None:
            return self._unread
        return self._unread + planned.seqs * bisect.bisect_right(planned.ends, trio.current_time())

    async def _run(self) -> list[Message]:
        while True:
            await self._turn()
            now = trio.current_time()
            if self._outbox and now >= self._held_until:
                frames, self._outbox = self._outbox, []
                return frames

    async def _turn(self) -> None:
        """One turn of the serving loop: frames in, a step (and its time), stats when due."""
        engine, loop = self.engine, self.loop
        self.catch_up()  # a run a cancelled read left planned
        inbox, self._inbox = self._inbox, []
        loop.take(inbox)
        self._arrived = trio.Event()
        if self._step is None and self.jump:
            self._plan = plan(engine, self.runner, trio.current_time(), loop.next_stats)
            if self._plan is not None:
                with trio.move_on_at(self._plan.ends[-1]):
                    await self._arrived.wait()
                self.catch_up()
        if self._step is None:
            steps = engine.steps
            output = loop.step()
            seconds = self.runner.last_step_seconds if engine.steps > steps else 0.0
            if output is not None and (output.tokens or output.finished or seconds):
                self._step = _Taken(trio.current_time() + seconds, [output])
        if self._step is not None:
            await trio.sleep_until(self._step.end)
            self._hand_out(self._step.outputs)
            self._step = None
        else:
            wake = loop.next_stats if not self._outbox else min(loop.next_stats, self._held_until)
            with trio.move_on_at(wake):
                await self._arrived.wait()
            self._arrived = trio.Event()
        now = trio.current_time()
        stats = loop.stats(now)
        if stats is not None:
            self._outbox.append(stats)
            self.reported_at = now

    def _hand_out(self, outputs: list[StepOutput]) -> None:
        """The frames of steps whose time has passed: all of them, or with ``jump`` only the
        first tokens and the ends (a sequence's other tokens wait for its end)."""
        if not self.jump:
            for output in outputs:
                self._outbox += step_messages(output)
            return
        # the steps of a run make a token for the same sequences, in the same order
        columns = zip(*(output.tokens.values() for output in outputs), strict=True)
        made = dict(zip(outputs[0].tokens, map(list, columns), strict=True))
        for output in outputs:
            for done in output.finished:
                ids = made.pop(done.rid, [])
                self._end(done.rid, ids[:-1] if done.reason in STOPS else ids, finished_message(done))
        for rid, ids in made.items():
            unsent = self._unsent.get(rid)
            if unsent is None:  # its first token: the request's first, out at once
                self._unsent[rid] = []
                self._outbox.append(Tokens(rid=rid, ids=ids))
            else:
                unsent += ids
                self._unread += len(ids)

    def _end(self, rid: int, last: list[int], finished: SequenceFinished) -> None:
        """A sequence ended: the ids it had not handed out (and ``last``), then its end."""
        ids = self._unsent.pop(rid, [])
        self._unread -= len(ids)
        if ids or last:
            self._outbox.append(Tokens(rid=rid, ids=ids + last))
        self._outbox.append(finished)


class SimulatedEngines:
    """A spawn for the :class:`~batcher.continuous.pool.EnginePool`: a fresh engine for a slot at each
    start, every one kept (``spawned[slot]``) so that tests and reports can reach them; with
    ``jump``, each jumps its runs of decode steps and merges its frames (see the module doc); each
    takes ``start_s`` seconds from spawn to ready."""

    def __init__(self, spec: EngineSpec, jump: bool = False, start_s: float = 0.0) -> None:
        spec.runner()  # a spec the runner refuses fails here, not at the pool's first start
        self.spec, self.jump, self.start_s = spec, jump, start_s
        self.spawned: dict[int, list[SimulatedEngine]] = {}

    def __call__(self, slot: int) -> SimulatedEngine:
        starts = self.spawned.setdefault(slot, [])
        engine = SimulatedEngine(self.spec, f"{slot}:{len(starts) + 1}", self.jump, self.start_s)
        starts.append(engine)
        return engine

    def current(self, slot: int) -> SimulatedEngine:
        """The engine started last in ``slot``."""
        return self.spawned[slot][-1]

    def unread(self, slot: int) -> int:
        """The tokens the engine of ``slot`` has made and not handed out by now (none in a slot
        never staffed)."""
        return self.current(slot).unread() if slot in self.spawned else 0


class ReadAhead(Router):
    """The pool's router for jumping engines: each replica's load as if its engine had handed out
    every token its steps have made by now (``unread``), as a step-by-step engine would have."""

    def __init__(self, router: Router, unread: Callable[[int], int]) -> None:
        super().__init__(router.capacity, router.bound)
        self._unread = unread

    def choose(self, loads: Sequence[float | None], hashes: Sequence[bytes]) -> Route:
        read = [None if load is None else load - self._unread(i) for i, load in enumerate(loads)]
        return super().choose(read, hashes)
