"""The fixed mode in virtual time: simulated ``run_batch`` workers, trace replay, load drivers,
reports and ``ferry simulate``."""
