"""ferry's worker processes (``python -m workers KIND``), their protocol, models and faults."""
