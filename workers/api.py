"""The worker API: the model object a fixed-mode worker builds once and calls for every batch.

A model table names it by import path (``worker = "my_pkg.embed:MiniLM"``: a class or a factory),
with ``pythonpath`` and ``worker_options``; the built-in kinds are targets in ``workers.models``.
:func:`build` imports it in the worker process alone, calls it with the options (and ``device``,
``"cuda:0"`` or ``"cpu"``, if it takes one) and runs its optional ``warmup()`` before ``ready``;
``close()``, if it has one, runs when the pool closes the worker's stdin. :func:`result` turns
what ``run_batch`` returned into the ``result`` frame: strings stay strings, vectors (lists of
numbers, rows of a 2-D numpy array or torch tensor) become packed little-endian float32.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from workers.protocol import Result


class Model(Protocol):
    """What the worker loop calls, one call at a time: one output per input, in order."""

    def run_batch(self, inputs: list[str]) -> Sequence[Any]: ...


def resolve(target: str, pythonpath: Iterable[str] = ()) -> Any:
    """The object ``module.path:Name`` (or ``:Name.attr``), imported with ``pythonpath`` first."""
    module_name, colon, attributes = target.partition(":")
    if not colon or not module_name or not attributes:
        raise ValueError(f"expected 'module:Name', got {target!r}")
    for directory in reversed(list(pythonpath)):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    found: Any = importlib.import_module(module_name)
    for name in attributes.split("."):
        found = getattr(found, name)
    return found


def slot_device() -> str:
    """This worker's device: ``cuda:0`` when the NVIDIA driver shows a GPU and the pool gave
    this process one (``CUDA_VISIBLE_DEVICES``), else ``cpu``. Read without importing torch, so a
    worker that never needs it starts in milliseconds."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        gpus = os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        gpus = []
    return "cuda:0" if gpus and visible.strip() not in ("", "-1") else "cpu"


def build(target: str, options: dict[str, Any], pythonpath: Iterable[str] = (), device: str = "cpu") -> Model:
    """Import ``target``, call it with ``options`` (and ``device``, where it takes one), check it
    has ``run_batch``, and warm it up. Any exception is the caller's: a model that cannot be built."""
    factory = resolve(target, pythonpath)
    if not callable(factory):
        raise TypeError(f"{target} is not a class or a function")
    kwargs = dict(options)
    if _takes(factory, "device"):
        kwargs.setdefault("device", device)  # worker_options may pin one
    model = factory(**kwargs)
    if not callable(getattr(model, "run_batch", None)):
        raise TypeError(f"{target}(...) returned {type(model).__name__}, which has no run_batch method")
    warmup = getattr(model, "warmup", None)
    if callable(warmup):
        warmup()
    return model


def model_name(model: Model, target: str) -> str:
    """What the worker's ``ready`` frame calls it: its ``name`` attribute, else its target."""
    name = getattr(model, "name", None)
    return name if isinstance(name, str) and name else target


def close(model: Model) -> None:
    """The model's ``close()``, if it has one (the worker is shutting down)."""
    closer = getattr(model, "close", None)
    if callable(closer):
        closer()


def _takes(factory: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it only its options
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def result(call: int, outputs: Any) -> Result:
    """The ``result`` frame of call ``call`` whose ``run_batch`` returned ``outputs`` (see the
    module doc); a ``TypeError`` or ``ValueError`` names the first output that is neither text
    nor a vector of finite numbers, or a mix of the two, and fails the call."""
    rows = _rows(outputs)
    if rows is not None:
        return Result(id=call, outputs=[], vectors=rows)
    if not isinstance(outputs, list | tuple):
        raise TypeError(f"run_batch returned {type(outputs).__name__}; expected a list, one output per input")
    texts = sum(isinstance(output, str) for output in outputs)
    if texts == len(outputs):
        return Result(id=call, outputs=list(outputs))
    if texts:
        raise TypeError(f"run_batch returned {texts} strings and {len(outputs) - texts} other outputs")
    vectors = [_vector(output, index) for index, output in enumerate(outputs)]
    return Result(id=call, outputs=[], vectors=vectors)


def _rows(outputs: Any) -> list[bytes] | None:
    """A 2-D numpy array or torch tensor, one vector a row; None if ``outputs`` is neither."""
    array = _as_float32(outputs)
    if array is None:
        return None
    if array.ndim != 2:
        shape = tuple(array.shape)
        raise ValueError(f"run_batch returned an array of shape {shape}; expected 2-D, a row per input")
    _check_finite(array, "a row")
    return [row.tobytes() for row in array]


def _vector(output: Any, index: int) -> bytes:
    array = _as_float32(output)
    if array is not None:
        if array.ndim != 1:
            raise ValueError(f"output {index}: expected a 1-D vector, got shape {tuple(array.shape)}")
        _check_finite(array, f"output {index}")
        return array.tobytes()
    if not isinstance(output, list | tuple) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in output
    ):
        kind = type(output).__name__
        raise TypeError(f"output {index}: expected a string or a vector of numbers, got {kind}")
    if not all(math.isfinite(v) for v in output):
        raise ValueError(f"output {index}: a value that is not a finite number")
    return struct.pack(f"<{len(output)}f", *output)


def _as_float32(value: Any) -> Any:
    """``value`` as a contiguous little-endian float32 numpy array, if it is an array or a tensor
    (numpy and torch are imported only if the model already has: its module is loaded)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", torch.float32).numpy()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return numpy.ascontiguousarray(value, dtype="<f4")
    return None


def _check_finite(array: Any, what: str) -> None:
    import numpy

    if not numpy.isfinite(array).all():
        raise ValueError(f"{what}: a value that is not a finite number")
