"""A user's own models, written as a package in a temporary directory outside the repository, the
way a team's code sits beside ferry: a text model and an embedding model behind the worker API.

``Shout`` answers each input upper-cased with a suffix (its option), ``device?`` with the device
it was built for; an input holding ``CRASH`` kills its worker, ``HANG`` hangs it, ``POISON``
raises. ``Embed`` answers each input with a vector of 4 (a numpy array, a row per input): its
length, its count of ``a``, 1, 0. Both note ``warmup()`` and ``close()`` in ``log_dir``.
"""

from __future__ import annotations

import pathlib

MODULE = '''
import os, time
import numpy


def note(log_dir, what):
    with open(os.path.join(log_dir, f"{what}-{os.getpid()}"), "w"):
        pass


class Shout:
    def __init__(self, suffix, log_dir, device):
        self.suffix, self.log_dir, self.device = suffix, log_dir, device

    def warmup(self):
        note(self.log_dir, "warm")

    def close(self):
        note(self.log_dir, "closed")

    def run_batch(self, inputs):
        if any("CRASH" in text for text in inputs):
            os._exit(7)
        if any("HANG" in text for text in inputs):
            time.sleep(3600)
        if any("POISON" in text for text in inputs):
            raise ValueError("a poisoned input")
        return [self.device if text.endswith("device?") else text.upper() + self.suffix for text in inputs]


class Embed:
    def __init__(self, log_dir):
        self.log_dir = log_dir

    def run_batch(self, inputs):
        return numpy.array([[len(t), t.count("a"), 1, 0] for t in inputs], dtype=numpy.float64)


def broken(**options):
    raise RuntimeError("no weights at /models/x")
'''


def write_user_package(root: pathlib.Path) -> pathlib.Path:
    """The package ``acme_models`` (module ``acme_models.serving``) under ``root/src``; its
    ``src`` directory, which a model table names in ``pythonpath``."""
    package = root / "src" / "acme_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "serving.py").write_text(MODULE)
    (root / "logs").mkdir()
    return root / "src"
