"""ferry's scheduling core: tier queues, flush policies, the batcher and the worker pool (trio)."""
