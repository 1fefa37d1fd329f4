"""The continuous engine that runs inside an engine worker process (docs/engine.md).

Every :meth:`Engine.step` is one forward pass over a mix of work: a token for each running
decode and a chunk of prompt for sequences still prefilling, within one token budget. A
sequence joins the batch on the step after it arrives and leaves on the step it finishes::

    add ──> Scheduler.waiting (per tier, FIFO) ──schedule──> running ──postprocess──> finished
                  ^                                             │
                  └──── preempt by recompute (lowest tier, newest first) ┘

Its KV cache is paged; one concept per file, pure where it can be. It meets the network through
the :class:`~workers.engine.batch.Runner` protocol: a torch runner, or one priced by a cost model."""
