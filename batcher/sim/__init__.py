"""Virtual-time replay of the production scheduler (no branch for it there): arrivals, load drivers,
trace replay, simulated workers and engines, reports and ``ferry simulate``.

Nothing in the production core imports this package: it drives the real
:class:`~batcher.fixed.batcher.Batcher` and :class:`~batcher.fixed.pool.WorkerPool` from the outside, with
in-process :class:`~batcher.sim.fixed.workers.SimulatedWorker`\\ s, and the real
:class:`~batcher.continuous.pool.EnginePool` with in-process
:class:`~batcher.sim.continuous.engine.SimulatedEngine`\\ s (the real engine scheduler over priced
steps), all under ``trio.testing.MockClock``.
"""
