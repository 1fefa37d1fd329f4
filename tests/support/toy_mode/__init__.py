"""A third serving mode, built the way a real one is: a package whose ``config`` holds the model
table's class and whose ``mode`` holds the :class:`~batcher.core.mode.Mode` (a preparation step,
a backend and its own metric family). ``tests/system/test_modes.py`` registers it.

The toy's backend answers each job at once with its prompt shouted (upper case, its own
``suffix`` after it), on the trio thread, without worker processes: what it shows is that the
core reaches a mode only through its registry entry. Its preparation notes, per model, whether
it ran inside the trio core, which is where start-up and a reload must both prepare.
"""
