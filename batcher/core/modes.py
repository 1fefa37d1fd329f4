"""The registry of serving modes: a model table's ``mode`` names its package here.

A mode is a package of two modules: ``config``, whose ``CONFIG`` is the model table's class
(light: loading a config file imports no backend), and ``mode``, whose ``MODE`` is its
:class:`~batcher.core.mode.Mode` (its backend over its workers, imported once a version of the
mode is prepared, opened or exported). The core reaches a mode only through these names, so a
new mode is its package and one line in :data:`MODES`; every version opens through
:func:`launch`, start-up and a reload alike, on the trio thread.
"""

from __future__ import annotations

import importlib
from typing import Any

from batcher.core.config import ModelConfig
from batcher.core.mode import Mode

MODES: dict[str, str] = {
    "fixed": "batcher.fixed",
    "continuous": "batcher.continuous",
}
"""Each mode by the name a model table's ``mode`` gives (default ``fixed``) -> its package."""


def config_class(name: str) -> type[ModelConfig]:
    """The model table class of mode ``name``; ``ValueError`` for a mode no entry serves."""
    config: type[ModelConfig] = importlib.import_module(f"{_package(name)}.config").CONFIG
    return config


def serving(name: str) -> Mode[Any, Any]:
    """The :class:`Mode` of mode ``name`` (its backend module imported on first use); found by
    name, so its model table's and counters' types are the mode's own business."""
    mode: Mode[Any, Any] = importlib.import_module(f"{_package(name)}.mode").MODE
    return mode


def mode_of(model: ModelConfig) -> Mode[Any, Any]:
    """The registered mode of a model; ``ValueError`` for a mode no entry serves."""
    return serving(model.mode)


def _package(name: str) -> str:
    package = MODES.get(name)
    if package is None:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {name!r}")
    return package
