"""An engine worker that lives in the gateway's trio run: the real engine over a priced runner.

:class:`SimulatedEngine` is what the :class:`~batcher.continuous.EnginePool` gets from its spawn
in place of an :class:`~batcher.engine_worker.EngineProcess`, behind the same surface: ``start``
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
engine without pause while it is up (``batcher/replica.py``), so the engine steps exactly while a
process would, and needs no task of its own. A step whose time has not yet passed when a read is
cancelled stays pending, and the next read waits out the rest of it.

Faults from outside, as a test or a chaos run causes them: :meth:`kill` is a SIGKILL (the next
read and every send raise ``WorkerLost``, ``wait_exit`` returns), :meth:`freeze` a SIGSTOP (alive
and silent: no step, no frame, until the pool's stats timeout kills it), :meth:`hold_output`
a gateway too busy to read (frames pile up, and one read brings many steps).

Under ``trio.testing.MockClock(autojump_threshold=0)`` a step costs no real time: the pool, the
router and admission are tested and replayed over hours of LLM traffic with exact times.

With a ``horizon`` (a callable: the next virtual time anything outside the engine acts on it),
a turn whose step is a pure decode advances every such step that ends by then at once
(:mod:`batcher.sim.jump`) and hands out their frames merged at the last one's end; without
one (the pool's logic tests) every step is its own turn and its own frames.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import trio
import trio.testing

from batcher.config import ContinuousModelConfig
from batcher.sim.jump import Leap
from workers.engine.config import EngineConfig
from workers.engine.cost_model import PRESETS, CostModel
from workers.engine.engine import Engine
from workers.engine.serve import STATS_INTERVAL, handle, step_messages
from workers.engine.simulated import SimulatedRunner
from workers.protocol import EngineStats, FrameDecoder, Message, ProtocolError, WorkerLost


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


class SimulatedEngine:
    """One simulated engine worker (see the module doc); ``name`` says which slot and start."""

    pid = None
    placement = "local"  # it runs inside this process

    def __init__(self, spec: EngineSpec, name: str, horizon: Callable[[], float] | None = None) -> None:
        self.name = name
        self.horizon = horizon
        self.leapt = 0  # steps taken inside runs of decode steps beyond the first of each
        self.runner = spec.runner()
        self.engine = Engine(self.runner, spec.engine, clock=trio.current_time)
        self.first_stats: EngineStats
        self.frozen = False
        self._decoder = FrameDecoder()
        self._inbox: list[Message] = []
        self._arrived = trio.Event()
        self._outbox: list[Message] = []
        self._step: tuple[float, list[Message]] | None = None  # a step run, its time not yet passed
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
        for message in self._inbox:
            handle(engine, message)
        self._inbox.clear()
        if self._step is None and engine.has_work and self.horizon is not None:
            run = Leap.first(engine, self.runner, trio.current_time(), self._next_stats)
            if run is not None:
                self._step = (run.end, run.frames())  # pending like any step if the read is cancelled
                await trio.testing.wait_all_tasks_blocked()  # the pool's reactions at this instant
                if not self._inbox and not run.over:
                    run.advance(self.horizon())
                    self._step = (run.end, run.frames())
                    self.leapt += run.steps - 1
        if self._step is None and engine.has_work:
            steps = engine.steps
            output = engine.step()
            seconds = self.runner.last_step_seconds if engine.steps > steps else 0.0
            frames = step_messages(output)
            if frames or seconds:
                self._step = (trio.current_time() + seconds, frames)
        if self._step is not None:
            await trio.sleep_until(self._step[0])
            self._outbox += self._step[1]
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

    def _stats(self) -> EngineStats:
        return self.engine.stats()


class SimulatedEngines:
    """A spawn for the :class:`~batcher.continuous.EnginePool`: a fresh engine for a slot at each
    start, every one kept (``spawned[slot]``) so that tests and reports can reach them; each
    jumps its pure decode steps up to ``horizon()`` if that is given (see the module doc)."""

    def __init__(self, spec: EngineSpec, horizon: Callable[[], float] | None = None) -> None:
        spec.runner()  # a spec the runner refuses fails here, not at the pool's first start
        self.spec, self.horizon = spec, horizon
        self.spawned: dict[int, list[SimulatedEngine]] = {}

    def __call__(self, slot: int) -> SimulatedEngine:
        starts = self.spawned.setdefault(slot, [])
        engine = SimulatedEngine(self.spec, f"{slot}:{len(starts) + 1}", self.horizon)
        starts.append(engine)
        return engine

    def current(self, slot: int) -> SimulatedEngine:
        """The engine started last in ``slot``."""
        return self.spawned[slot][-1]
