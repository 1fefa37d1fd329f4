"""A workload through the production continuous mode in virtual time: pool, router, admission,
and the real engine scheduler over priced runners (:mod:`batcher.sim.continuous.engine`).

:func:`replay` runs a :class:`~batcher.sim.continuous.workload.Workload` under
``trio.testing.MockClock(autojump_threshold=0)`` through an
:class:`~batcher.continuous.pool.EnginePool` whose spawn makes
:class:`~batcher.sim.continuous.engine.SimulatedEngine`\\ s, and records what each request's caller
saw (:class:`Outcomes`): when it was sent, its first token, its end, its tokens, and how it
ended. Every request is streamed, so its first token is seen when its engine makes it.

A conversation's next turn is sent at its time in the workload, but never before the previous
turn's answer has ended (its user reads it first); its prompt carries the earlier turns'
prompts and the answers' very ids (:class:`IdText` makes an id one character, so they come back
from the text), which is what lets the replica that served the conversation hit its prefix cache.

With ``jump`` (the default of ``ferry simulate --mode continuous``) the engines wait out runs of
pure decode steps at once and hand each sequence's tokens out at its first token and at its end
(:mod:`batcher.sim.continuous.engine`), and the pool's router is a
:class:`~batcher.sim.continuous.engine.ReadAhead`, which counts the tokens not yet handed out,
so that every routing decision sees the loads a step-by-step replay would; a KV sample first
brings every engine's run to the sample's time. A stream's deltas come merged,
its first token and end at the same times. What it can change (``docs/simulation-continuous.md``
says more): the pool makes a dispatch pass after every engine read, and the tier queues'
aged-work credit grows at each pass, so with fewer reads a free request queued past the age
limit may be taken ahead of paid work at another moment. With one tier, or with nothing queued
past the age limit, the replay is the step-by-step one (``tests/pure/test_decode_run.py``).

A seed fixes the workload and the run: trio's order of the tasks woken at one virtual instant
(a replica's read and the next turn it lets in) is drawn from it too (:mod:`batcher.sim.virtual`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.mode import open_continuous
from batcher.continuous.pool import EnginePool
from batcher.core.backend import Delta, Failed, Finished, Job, Sampling
from batcher.core.config import QueueConfig
from batcher.core.errors import Expired, Overloaded, Shed
from batcher.sim.continuous.engine import EngineSpec, ReadAhead, SimulatedEngines
from batcher.sim.continuous.workload import Workload
from batcher.sim.progress import Progress
from batcher.sim.virtual import run_virtual

FIRST_ID = 0x10000  # ids as characters from here: past the surrogates for any vocabulary below 1 M
OUTCOMES = ("pending", "finished", "shed", "expired", "failed")
PENDING, FINISHED, SHED, EXPIRED, FAILED = range(len(OUTCOMES))


class _IdDetokenizer:
    def push(self, ids: list[int]) -> str:
        return "".join(chr(FIRST_ID + i) for i in ids)

    def flush(self) -> str:
        return ""


class IdText:
    """The replay's tokenizer: one character per id, so that an answer's ids are its text."""

    def detokenizer(self) -> _IdDetokenizer:
        return _IdDetokenizer()


def ids_of(text: str) -> list[int]:
    return [ord(c) - FIRST_ID for c in text]


class Outcomes:
    """What each request's caller saw, in arrays indexed like the workload.

    ``duplicates`` counts events that came after a request's end: conservation (every request
    answered, shed, expired or failed exactly once) holds when it is 0 and none is pending.
    ``retry_after`` is the Retry-After a shed or expired request was told (seconds; NaN otherwise)."""

    def __init__(self, count: int) -> None:
        self.sent = np.full(count, np.nan)
        self.first = np.full(count, np.nan)
        self.end = np.full(count, np.nan)
        self.tokens = np.zeros(count, dtype=np.int64)
        self.outcome = np.zeros(count, dtype=np.int8)
        self.retry_after = np.full(count, np.nan)
        self.duplicates = 0
        self.ended = 0

    def counts(self) -> dict[str, int]:
        return {name: int((self.outcome == code).sum()) for code, name in enumerate(OUTCOMES)}

    def record(self, index: int, event: object, now: float) -> bool:
        """Take one event of request ``index``; True if it ended the request."""
        if self.outcome[index] != PENDING:
            self.duplicates += 1
            return False
        if isinstance(event, Delta):
            if not self.tokens[index]:
                self.first[index] = now
            self.tokens[index] += event.tokens
            return False
        if isinstance(event, Finished):
            self.outcome[index] = FINISHED
        elif isinstance(event, Failed):
            error = event.error
            if isinstance(error, Overloaded):
                self.retry_after[index] = error.retry_after
            self.outcome[index] = (
                SHED if isinstance(error, Shed) else EXPIRED if isinstance(error, Expired) else FAILED
            )
        else:
            return False
        self.end[index] = now
        self.ended += 1
        return True


class Prompts:
    """Each request's prompt ids: its shared prefix, its conversation so far, its new tokens."""

    def __init__(self, workload: Workload, vocab: int, seed: int) -> None:
        self.workload, self._vocab, self._seed = workload, vocab, seed
        self._history: dict[int, tuple[int, ...]] = {}
        self._prefixes: dict[int, tuple[int, ...]] = {}

    def prompt(self, index: int) -> tuple[int, ...]:
        workload = self.workload
        conversation, prefix = int(workload.conversation[index]), int(workload.prefix[index])
        head = self._history.get(conversation, ()) if conversation >= 0 else ()
        if not head and prefix >= 0:
            if prefix not in self._prefixes:
                self._prefixes[prefix] = self._draw(1, prefix, workload.prefix_tokens)
            head = self._prefixes[prefix]
        prompt = head + self._draw(0, index, int(workload.prompt[index]))
        if conversation >= 0:
            self._history[conversation] = prompt
        return prompt

    def answered(self, index: int, ids: list[int]) -> None:
        conversation = int(self.workload.conversation[index])
        if conversation >= 0:
            self._history[conversation] += tuple(ids)

    def _draw(self, kind: int, key: int, count: int) -> tuple[int, ...]:
        rng = np.random.default_rng((self._seed, kind, key))
        return tuple(rng.integers(3, self._vocab, count).tolist())  # 0..2: special ids


@dataclasses.dataclass(frozen=True)
class Replayed:
    """A finished replay: the outcomes, the engines' counters, KV use over time, its cost."""

    workload: Workload
    outcomes: Outcomes
    replicas: list[dict[str, int]]  # per replica: its engines' counters summed over restarts
    kv_use: np.ndarray  # samples x replicas: used blocks / total
    used_at_end: list[int]  # blocks each replica's engine still held once every request had ended
    virtual_seconds: float
    cpu_seconds: float
    shed_by_pool: int
    held: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # replicas held, each sample


async def drive(
    pool: EnginePool,
    workload: Workload,
    prompts: Prompts,
    outcomes: Outcomes,
    done: trio.Event,
    prefix_cache: bool,
) -> None:
    """Send each request at its time, a conversation's turn only once the previous has ended;
    set ``done`` once every request has ended."""
    waiting: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)
    open_turns: set[int] = set()
    ready: list[int] = []
    wake = [trio.Event()]
    answers: dict[int, list[str]] = {}
    start = trio.current_time()

    def send(index: int) -> None:
        conversation = int(workload.conversation[index])
        if conversation >= 0:
            open_turns.add(conversation)
        answers[index] = []
        outcomes.sent[index] = trio.current_time()
        tier, tenant = workload.tiers[workload.tier[index]], "" if prefix_cache else str(index)
        job = Job("", prompts.prompt(index), Sampling(int(workload.answer[index])), tier, tenant, stream=True)
        pool.submit(job, lambda event: on_event(index, event))

    def on_event(index: int, event: object) -> None:
        if isinstance(event, Delta):
            answers[index].append(event.text)
        if not outcomes.record(index, event, trio.current_time()):
            return
        text = "".join(answers.pop(index))
        prompts.answered(index, ids_of(text) if isinstance(event, Finished) else [])
        conversation = int(workload.conversation[index])
        if conversation >= 0:
            open_turns.discard(conversation)
            if waiting[conversation]:
                ready.append(waiting[conversation].popleft())
                wake[0].set()
        if outcomes.ended == len(workload):
            done.set()

    following = 0
    while True:  # until cancelled, once every request has ended
        due = start + workload.times[following] if following < len(workload) else math.inf
        with trio.move_on_at(due):
            await wake[0].wait()
        wake[0] = trio.Event()
        while ready:  # a turn shed at once readies the next turn of its conversation
            turns = sorted(ready)  # not in the order trio happened to run their ends
            ready.clear()
            for index in turns:
                send(index)
        now = trio.current_time()
        while following < len(workload) and start + workload.times[following] <= now:
            conversation = int(workload.conversation[following])
            if conversation >= 0 and (conversation in open_turns or waiting[conversation]):
                waiting[conversation].append(following)
            else:
                send(following)
            following += 1


async def _sample(
    spawn: SimulatedEngines,
    pool: EnginePool,
    every: float,
    kv_use: list[list[float]],
    held: list[int],
    progress: Callable[[float], None] | None,
) -> None:
    while True:
        await trio.sleep(every)
        row = []
        for slot in range(len(pool.replicas)):
            if slot not in spawn.spawned:  # a slot the scaler has not staffed yet
                row.append(0.0)
                continue
            engine = spawn.current(slot)
            engine.catch_up()  # its blocks as they are now, a run of decode steps committed to now
            blocks = engine.engine.scheduler.blocks
            row.append(blocks.num_used / blocks.num_blocks)
        kv_use.append(row)
        held.append(pool.staffing.staffed)
        if progress is not None:
            progress(trio.current_time())


def counters(spawn: SimulatedEngines, workers: int) -> list[dict[str, int]]:
    """Each replica's engine counters, summed over the engines its slot has had."""
    names = ("steps", "preemptions", "prefix_queries", "prefix_hits", "computed_tokens", "generated_tokens")
    totals = []
    for slot in range(workers):
        total = dict.fromkeys(names, 0)
        for engine in spawn.spawned.get(slot, []):
            stats = engine.engine.stats()
            for name in names:
                total[name] += stats.step if name == "steps" else getattr(stats, name)
        totals.append(total)
    return totals


def replay(
    workload: Workload,
    model: ContinuousModelConfig,
    queue: QueueConfig,
    spec: EngineSpec,
    *,
    seed: int = 0,
    sample_every: float = 1.0,
    progress: Callable[[Progress], None] | None = None,
    prefix_cache: bool = True,
    drain: float = 3600.0,
    jump: bool = False,
    start_s: float = 0.0,
) -> Replayed:
    """Run ``workload`` to its end in virtual time (see the module doc). ``prefix_cache=False``
    gives every request a tenant of its own, which salts its blocks' hashes: no prompt hits
    another's blocks, the cache is off as far as the traffic can tell. A run with requests still
    open ``drain`` virtual seconds after the last arrival stops with RuntimeError: the pool's
    deadlines end every request, so that is a bug, not a long run. ``jump``: advance runs of pure
    decode steps at once and merge the engines' frames (see the module doc). ``start_s``: each
    engine's spawn to ready; a model with ``min_workers``/``max_workers`` runs the production scaler."""
    if not len(workload):
        raise ValueError("replay: the workload has no request")
    if tuple(queue.tiers) != workload.tiers:
        raise ValueError(f"replay: the workload's tiers {workload.tiers} are not the queue's {queue.tiers}")
    outcomes = Outcomes(len(workload))
    spawn = SimulatedEngines(spec, jump, start_s)
    slots = model.pool_config().workers
    kv_use: list[list[float]] = []
    held: list[int] = []
    cpu = time.process_time()
    span = float(workload.times[-1])

    def tell(now: float) -> None:
        assert progress is not None
        progress(Progress(now, span, outcomes.ended, len(workload), time.process_time() - cpu))

    async def run() -> tuple[float, int]:
        done = trio.Event()
        prompts = Prompts(workload, spec.vocab or spec.cost.shape.vocab, seed)
        async with open_continuous(model, queue, spawn, IdText()) as pool:
            if jump:  # its engines hand a sequence's tokens out at its end: its router counts them
                pool.router = ReadAhead(pool.router, spawn.unread)
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _sample, spawn, pool, sample_every, kv_use, held, None if progress is None else tell
                )
                nursery.start_soon(drive, pool, workload, prompts, outcomes, done, prefix_cache)
                with trio.move_on_at(start + span + drain):
                    await done.wait()
                nursery.cancel_scope.cancel()
            return trio.current_time() - start, sum(pool.snapshot().counters.shed.values())

    virtual, shed = run_virtual(run, seed=seed)
    if outcomes.ended < len(workload):
        raise RuntimeError(
            f"replay: {len(workload) - outcomes.ended} requests had not ended {drain:g} virtual s "
            "after the last arrival"
        )
    kv = np.asarray(kv_use) if kv_use else np.zeros((0, slots))
    used = [spawn.current(slot).engine.scheduler.blocks.num_used if slot in spawn.spawned else 0
            for slot in range(slots)]
    return Replayed(workload, outcomes, counters(spawn, slots), kv, used, virtual, time.process_time() - cpu,
                    shed, np.asarray(held))
