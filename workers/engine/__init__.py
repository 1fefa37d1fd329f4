"""The continuous engine that runs inside an LLM worker process (docs/continuous.md).

Theory of operation. Every call to :meth:`Engine.step` is one forward pass over a mix of work:
one token for each running decode and a chunk of prompt for sequences still prefilling, all
within one token budget (``max_batch_tokens``). Nothing waits for a batch to finish: a sequence
joins the batch on the step after it arrives and leaves on the step it finishes.

    add ──> Scheduler.waiting (per tier, FIFO) ──schedule──> running ──postprocess──> finished
                  ^                                             │
                  └──── preempt by recompute (lowest tier, newest first) ┘

Memory is paged: the KV cache is ``num_blocks`` blocks of ``block_size`` token slots, and each
sequence owns a block table (its blocks, in order). Token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``::

    positions   0 ......... 15 | 16 ........ 31 | 32 .. 37
    blocks      [ block 7     ] [ block 2      ] [ block 9  (6 of 16 used) ]

One concept per file, each small (nano-vllm's shape):

- ``sequence``       pure: a request's tokens, its sampling, state and timestamps
- ``config``         pure: :class:`~workers.engine.config.EngineConfig`, the cache and step limits
- ``batch``          the :class:`~workers.engine.batch.Runner` protocol, and the
  :class:`~workers.engine.batch.ForwardBatch` a model's runner lays a step out as
- ``block_manager``  pure: blocks, block tables, ref counts, LRU free list, prefix cache
- ``scheduler``      pure: one token budget per step, chunked prefill, preemption
- ``decode_run``     pure: a run of identical decode steps, which the scheduler takes its own through
- ``cost_model``     pure: the time of one step from a model's shape and a GPU's speeds
- ``checkpoint``     a Hugging Face directory's shape, RoPE, stop tokens, chat template, weights
- ``attention``      torch: write K and V to their slots, attend each sequence to its own blocks
- ``model``          torch: a Llama-family network whose attention reads and writes the paged cache
- ``sampler``        torch: greedy, temperature, top-k, top-p, per-request seeds
- ``runner``         torch: the :class:`~workers.engine.batch.Runner` of a real model: weights,
  the KV cache and the sampler, one ``execute`` per step
- ``interface``      pure: :class:`~workers.engine.interface.EngineCore`, what the loop needs of an engine
- ``engine``         ``add`` / ``abort`` / ``step``: the scheduler, the block manager and a runner
- ``simulated``      pure: a runner with no model, its steps priced by the cost model
- ``loop``           pure: the serving loop of every engine, frames in and out, no I/O
- ``serve``          ``python -m workers engine``: that loop behind the framed pipe

Around it, not in it: ``workers/convert.py`` turns SmolLM2-135M's GGUF into the model directory
the engine loads; ``experiments/static_batch.py`` is the padded static batch it is measured
against; ``tests/support/tiny_checkpoint.py`` writes the tiny checkpoints the tests load.

The engine talks to the network through the :class:`~workers.engine.batch.Runner` protocol: the
torch model runner in a worker process, or a simulated runner priced by the cost model, so the
same scheduler and block manager replay LLM traffic in virtual time.
"""
