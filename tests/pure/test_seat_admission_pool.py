"""The pool's admission counts the seat bound of a TPOT target, in virtual time (MockClock): the
real pool, router, admission and dispatch, over ferry's engine run as the simulated engine process
priced by the SmolLM2 step costs that both it and the pool read. A 50 ms paid target seats 3
sequences of 300 tokens (a step of 4 is priced 55 ms). Tenant H holds all 3 with long answers;
its fourth request would wait seconds for a seat, over the 500 ms budget: shed at arrival with a
Retry-After no sooner than that wait. Tenant L's, under its share, is admitted and answered.
"""

from __future__ import annotations

import dataclasses

import trio

from batcher.continuous.config import ContinuousModelConfig
from batcher.continuous.pool import open_engine_pool
from batcher.core.backend import Delta, Failed, Finished
from batcher.core.config import QueueConfig
from batcher.core.errors import Expired, Shed
from batcher.sim.continuous.engine import EngineSpec, SimulatedEngines
from gateway.text.tokenizer import ByteTokenizer
from tests.support.engine_pool import Client, job
from workers.engine.fit import cost_fit

COSTS = "experiments/step_costs/smollm2-135m-bf16-cpu.json"
QUEUE = QueueConfig(wait_budgets=(0.5, 10.0), tpot_targets=(0.050, 0.0))


async def test_a_tenant_holding_every_seat_is_shed_at_arrival_and_a_light_one_answered(autojump_clock):
    config = ContinuousModelConfig(name="sim@1", simulated="smollm2-135m", workers=1, num_blocks=256,
                                   max_batch_tokens=256, max_seqs=16, step_costs=COSTS)
    spawn = SimulatedEngines(EngineSpec.of(config, cost=cost_fit.load(COSTS)))
    async with open_engine_pool(config, QUEUE, spawn, ByteTokenizer()) as pool:
        with trio.fail_after(60):
            while not pool.ready:
                await trio.sleep(0.01)
        heavy = [Client() for _ in range(3)]
        for n, client in enumerate(heavy):
            pool.submit(dataclasses.replace(job(n, 200, True, length=100), tenant="H"), client)
        while not all(any(isinstance(e, Delta) for e in c.events) for c in heavy):
            await trio.sleep(0.01)  # each of H's sequences holds a seat
        fourth, light = Client(), Client()
        pool.submit(dataclasses.replace(job(3, 200, True, length=100), tenant="H"), fourth)
        pool.submit(dataclasses.replace(job(4, 8, False, length=100), tenant="L"), light)
        assert fourth.done.is_set(), "shed at arrival"
        error = fourth.events[-1].error
        assert isinstance(fourth.events[-1], Failed) and isinstance(error, Shed)
        assert not isinstance(error, Expired)
        assert error.retry_after > 1.0  # about one of H's 200-token answers at 3 a step of ~50 ms
        await light.done.wait()
        assert isinstance(light.events[-1], Finished)
        for client in heavy:
            await client.done.wait()
            assert isinstance(client.events[-1], Finished)
