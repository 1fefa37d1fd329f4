"""``ferry fit``: time the real engine's steps on this machine and fit the step-cost model that
the continuous simulation prices steps with."""
