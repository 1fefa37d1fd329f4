"""The fixed mode: the Batcher (tier queues, flush by size or timeout) in front of a
WorkerPool of ``run_batch`` worker processes (supervision, retries, bisection of poison inputs)."""
