"""An engine worker that lives in the gateway's trio run: the real engine over a priced runner.

:class:`SimulatedEngine` is what the :class:`~batcher.continuous.pool.EnginePool` gets from its spawn
in place of an :class:`~batcher.continuous.engine_process.EngineProcess`, behind the same surface: ``start``
(``ready``, then the first ``stats``), ``send`` (encoded ``add`` and ``abort`` frames),
``receive`` (the frames of one read), ``wait_exit`` and ``stop``. Inside it is the production
:class:`~workers.engine.engine.Engine` (scheduler, block manager, prefix cache) over a
:class:`~workers.engine.simulated.SimulatedRunner`, so every scheduling decision is the real
engine's, and only the forward pass is priced instead of run.

The engine's loop is the worker process's (``workers/engine/serve.py``), turn for turn: take the
frames that have arrived, run one step, let the step's time pass
(``await trio.sleep_until(...)`` of the runner's ``last_step_seconds``), hand out its frames and a
``stats`` frame every :data:`~workers.engine.serve.STATS_INTERVAL`; while idle, wait for a frame or
the next ``stats``. The loop runs inside :meth:`SimulatedEngine.receive`: the pool reads an
engine without pause while it is up (``batcher/continuous/replica.py``), so the engine steps exactly while a
process would, and needs no task of its own. A step whose time has not yet passed when a read is
cancelled stays pending, and the next read waits out the rest of it.

Faults from outside, as a test or a chaos run causes them: :meth:`kill` is a SIGKILL (the next
read and every send raise ``WorkerLost``, ``wait_exit`` returns), :meth:`freeze` a SIGSTOP (alive
and silent: no step, no frame, until the pool's stats timeout kills it), :meth:`hold_output`
a gateway too busy to read (frames pile up, and one read brings many steps).

Under ``trio.testing.MockClock(autojump_threshold=0)`` a step costs no real time: the pool, the
router and admission are tested and replayed over hours of LLM traffic with exact times.

With ``jump`` (the replay's default), two things make a long replay cheap, each leaving every
time and token the pool's callers see as a step-by-step engine would make them:

- A turn whose step is a pure decode plans the run of identical steps from it
  (:mod:`batcher.sim.continuous.jump`) and waits for its end, or for anything that reaches the engine first:
  a frame from the pool (:meth:`send`), or a look at its blocks (:meth:`catch_up`). Then it
  commits the steps ended by then and the one under way, as a worker would have run them, and
  takes the new work after that one, as a worker would.
- A sequence's tokens are handed out when the pool needs them: its first token at once (its
  time is the request's first token, and it frees the pool's prefill room), the rest with its
  end; meanwhile :meth:`unread` counts what the pool has not seen, and the pool's router takes
  it off the replica's load, which then reads as if every step's frames had been read. A
  stream's text arrives as two deltas, the first token and the rest. A whole answer's stop
  sequences are seen only at its end: the replay streams every request.

Without it (the pool's logic tests) every step is its own turn and its own frames; the faults
above are for that engine (a jumping one killed would take its unsent tokens with it).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import trio
import trio.testing

from batcher.continuous.config import ContinuousModelConfig
from batcher.sim.continuous.jump import Leap
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS, CostModel
from workers.engine.engine import Engine, StepOutput
from workers.engine.serve import STATS_INTERVAL, STOPS, finished_message, handle, step_messages
from workers.engine.simulated import SimulatedRunner
from workers.protocol import (
    EngineStats,
    FrameDecoder,
    Message,
    ProtocolError,
    SequenceFinished,
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
    """Steps the engine has run whose time has not yet passed: one ``Engine.step`` (its output),
    or a committed run of decode steps."""

    end: float
    output: StepOutput | None = None
    run: Leap | None = None


class SimulatedEngine:
    """One simulated engine worker (see the module doc); ``name`` says which slot and start."""

    pid = None
    placement = "local"  # it runs inside this process

    def __init__(self, spec: EngineSpec, name: str, jump: bool = False) -> None:
        self.name = name
        self.jump = jump
        self.leapt = 0  # steps taken inside runs of decode steps beyond the first of each
        self.cut = 0  # runs that work or a look reached before their planned end
        self.runner = spec.runner()
        self.engine = Engine(self.runner, spec.engine, clock=trio.current_time)
        self.first_stats: EngineStats
        self.frozen = False
        self._decoder = FrameDecoder()
        self._inbox: list[Message] = []
        self._arrived = trio.Event()
        self._outbox: list[Message] = []
        self._step: _Taken | None = None  # steps run, their time not yet passed
        self._plan: Leap | None = None  # a run planned, none of it committed yet
        self._unsent: dict[int, list[int]] = {}  # rid -> ids not handed out, once its first is
        self._unread = 0  # ids in _unsent
        self._next_stats = 0.0
        self.reported_at = 0.0  # when it last sent stats (the pool kills an engine silent too long)
        self._held_until = -math.inf
        self._exited = trio.Event()
        self._reading = trio.CancelScope()

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()
        self.first_stats = self._stats()
        self.reported_at = trio.current_time()
        self._next_stats = self.reported_at + STATS_INTERVAL

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
                if self.frozen:
                    await trio.sleep_forever()
                try:
                    return await self._run()
                except ProtocolError:
                    self._exited.set()  # a worker process exits on a frame it refuses
                    raise
        raise WorkerLost(f"simulated engine {self.name} was killed")

    async def wait_exit(self) -> None:
        await self._exited.wait()

    async def stop(self) -> None:
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

    def hold_output(self, seconds: float) -> None:
        """Nobody reads for ``seconds``: the engine runs on and its frames wait to be read."""
        self._held_until = trio.current_time() + seconds

    def catch_up(self) -> None:
        """Bring a planned run to now, where a step-by-step engine would be: the steps ended by
        now and the one under way committed, the rest never taken. Whatever acts on the engine
        or reads its state from outside calls this first."""
        run, self._plan = self._plan, None
        if run is None:
            return
        steps = min(len(run.ends), bisect.bisect_right(run.ends, trio.current_time()) + 1)
        self.cut += steps < len(run.ends)
        run.take(steps)
        self.leapt += steps - 1
        self._step = _Taken(run.end, run=run)
        self._arrived.set()  # the loop waits out the run's new end

    def unread(self) -> int:
        """Tokens its steps have made by now that the pool has not been handed (see the module
        doc): what the pool's view of this replica's load lacks."""
        run = self._plan or (self._step.run if self._step is not None else None)
        if run is None:
            return self._unread
        return self._unread + len(run.seqs) * bisect.bisect_right(run.ends, trio.current_time())

    async def _run(self) -> list[Message]:
        while True:
            await self._turn()
            now = trio.current_time()
            if self._outbox and now >= self._held_until:
                frames, self._outbox = self._outbox, []
                return frames

    async def _turn(self) -> None:
        """One turn of the worker's loop: frames in, a step (and its time), stats when due."""
        engine = self.engine
        self.catch_up()  # a run a cancelled read left planned
        for message in self._inbox:
            handle(engine, message)
        self._inbox.clear()
        self._arrived = trio.Event()
        if self._step is None and engine.has_work and self.jump:
            self._plan = Leap.plan(engine, self.runner, trio.current_time(), self._next_stats)
            if self._plan is not None:
                with trio.move_on_at(self._plan.end):
                    await self._arrived.wait()
                self.catch_up()
        if self._step is None and engine.has_work:
            steps = engine.steps
            output = engine.step()
            seconds = self.runner.last_step_seconds if engine.steps > steps else 0.0
            if output.tokens or output.finished or seconds:
                self._step = _Taken(trio.current_time() + seconds, output)
        if self._step is not None:
            await trio.sleep_until(self._step.end)
            self._hand_out(self._step)
            self._step = None
        else:
            wake = self._next_stats if not self._outbox else min(self._next_stats, self._held_until)
            with trio.move_on_at(wake):
                await self._arrived.wait()
            self._arrived = trio.Event()
        now = trio.current_time()
        if now >= self._next_stats:
            self._outbox.append(self._stats())
            self.reported_at, self._next_stats = now, now + STATS_INTERVAL

    def _hand_out(self, taken: _Taken) -> None:
        """The frames of steps whose time has passed: all of them, or with ``jump`` only the
        first tokens and the ends (a sequence's other tokens wait for its end)."""
        output, run = taken.output, taken.run
        if run is not None:
            made = {seq.rid: ids for seq, ids in zip(run.seqs, run.ids, strict=True)}
            ended = run.ended
        else:
            assert output is not None
            if not self.jump:
                self._outbox += step_messages(output)
                return
            made = {rid: [token] for rid, token in output.tokens.items()}
            ended = output.finished
        for done in ended:
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

    def _stats(self) -> EngineStats:
        return self.engine.stats()


class SimulatedEngines:
    """A spawn for the :class:`~batcher.continuous.pool.EnginePool`: a fresh engine for a slot at each
    start, every one kept (``spawned[slot]``) so that tests and reports can reach them; with
    ``jump``, each jumps its runs of decode steps and merges its frames (see the module doc)."""

    def __init__(self, spec: EngineSpec, jump: bool = False) -> None:
        spec.runner()  # a spec the runner refuses fails here, not at the pool's first start
        self.spec, self.jump = spec, jump
        self.spawned: dict[int, list[SimulatedEngine]] = {}

    def __call__(self, slot: int) -> SimulatedEngine:
        starts = self.spawned.setdefault(slot, [])
        engine = SimulatedEngine(self.spec, f"{slot}:{len(starts) + 1}", self.jump)
        starts.append(engine)
        return engine

    def current(self, slot: int) -> SimulatedEngine:
        """The engine started last in ``slot``."""
        return self.spawned[slot][-1]

    def unread(self, slot: int) -> int:
        """The tokens the engine of ``slot`` has made and not handed out by now: the pool's
        ``unread`` (see :class:`~batcher.continuous.pool.EnginePool`)."""
        return self.current(slot).unread()
