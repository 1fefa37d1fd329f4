"""The continuous mode in virtual time: the real engine scheduler over priced steps, workloads,
the replay driver and its report (``ferry simulate --mode continuous``)."""
