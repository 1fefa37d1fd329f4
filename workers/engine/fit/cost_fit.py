"""Step costs fitted to measured engine steps, and the file that carries them. Pure but for the file.

:func:`fit` takes steps a real engine ran (:class:`Measured`: query and context lengths, seconds)
and returns the :class:`~workers.engine.cost_model.Overhead` that prices them best::

    seconds = step + seq x sequences + token x query tokens + context x context tokens
              + pair x attention pairs

by least squares on the relative error (a 20 ms decode counts as much as a 1 s prefill: the
simulation's TPOT is made of the small ones), every constant at least 0. The roofline is not
fitted: on a CPU a step is a sum of per-operator costs. The file (JSON) holds the model's shape,
the overhead and how it was measured; :func:`load` reads it back as a cost model."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from workers.engine.cost_model import CostModel, Hardware, ModelShape, Overhead, attention_pairs

TERMS = ("step", "seq", "token", "context", "pair")
FORMAT = "ferry step costs 1"


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """One step a real engine ran: its sequences' query and context lengths, its seconds."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float

    def __post_init__(self) -> None:
        if not self.query_lens or len(self.query_lens) != len(self.context_lens):
            raise ValueError(
                f"measured step: expected as many query as context lengths, at least one, got "
                f"{len(self.query_lens)} and {len(self.context_lens)}"
            )
        if any(not 1 <= q <= c for q, c in zip(self.query_lens, self.context_lens, strict=True)):
            raise ValueError("measured step: expected 1 <= query length <= context length per sequence")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"measured step: expected seconds > 0, got {self.seconds}")

    def counts(self) -> tuple[int, int, int, int, int]:
        """The step's count of each of :data:`TERMS` (1 for the step itself)."""
        q, c = self.query_lens, self.context_lens
        pairs = sum(attention_pairs(a, b) for a, b in zip(q, c, strict=True))
        return 1, len(q), sum(q), sum(c), pairs


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """The fitted overhead, and how far its prices fall from the measured steps (relative)."""

    overhead: Overhead
    steps: int
    median_error: float  # |predicted / measured - 1|, the median over the steps
    worst_error: float


def fit(records: Sequence[Measured]) -> Fit:
    """The nonnegative :class:`Overhead` closest to ``records`` in relative error (module doc).

    ValueError when the steps cannot tell the terms apart: too few of them, or a design in which
    two counts move together (only decodes, say: their query tokens are their sequences)."""
    if len(records) < len(TERMS):
        raise ValueError(f"fit: expected at least {len(TERMS)} measured steps, got {len(records)}")
    counts = np.array([record.counts() for record in records], dtype=float)
    seconds = np.array([record.seconds for record in records])
    scaled = counts / seconds[:, None]  # relative error: each row divided by its measured time
    scale = np.abs(scaled).max(axis=0)
    unused = [TERMS[i] for i in np.flatnonzero(scale == 0)]
    if unused:
        raise ValueError(f"fit: no measured step has any {', '.join(unused)}")
    design = scaled / scale
    if np.linalg.matrix_rank(design, tol=1e-9) < len(TERMS):
        raise ValueError(
            "fit: the measured steps cannot tell the terms apart "
            f"({', '.join(TERMS)}); measure decodes at several batch sizes and contexts, prefill "
            "chunks of several sizes, and mixed steps"
        )
    kept = list(range(len(TERMS)))
    while True:
        solution, *_ = np.linalg.lstsq(design[:, kept], np.ones(len(records)), rcond=None)
        if solution.min() >= 0 or len(kept) == 1:
            break
        del kept[int(np.argmin(solution))]  # priced below 0: that term is not in this data
    constants = np.zeros(len(TERMS))
    constants[kept] = np.maximum(solution, 0.0) / scale[kept]
    overhead = Overhead(*constants.tolist())
    errors = np.abs(counts @ constants / seconds - 1)
    return Fit(overhead, len(records), float(np.median(errors)), float(errors.max()))


def as_dict(cost: CostModel, about: dict[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`save` writes: ``cost``'s shape, roofline and overhead, and ``about`` (how it
    was measured, how well it fits)."""
    hardware: dict[str, Any] = {"name": cost.hardware.name, "gpus": cost.hardware.gpus}
    if math.isfinite(cost.hardware.bandwidth):
        hardware["bandwidth"] = cost.hardware.bandwidth
    if math.isfinite(cost.hardware.flops):
        hardware["flops"] = cost.hardware.flops
    return {
        "format": FORMAT,
        "shape": dataclasses.asdict(cost.shape),
        "hardware": hardware,
        "overhead_seconds": dataclasses.asdict(cost.overhead),
        "about": about or {},
    }


def from_dict(data: dict[str, Any], source: str = "cost file") -> CostModel:
    """The cost model :func:`as_dict` describes; ValueError naming what is wrong and where."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: expected a {FORMAT!r} file (ferry fit writes one)")
    hardware = data.get("hardware")
    if isinstance(hardware, dict):  # an unbounded roofline is written without its speeds
        hardware = {"bandwidth": math.inf, "flops": math.inf, **hardware}
    parts: dict[str, Any] = {}  # each part converted into its own kind
    for name, kind, value in (("shape", ModelShape, data.get("shape")), ("hardware", Hardware, hardware),
                              ("overhead_seconds", Overhead, data.get("overhead_seconds"))):
        try:
            parts[name] = msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{source}: {name}: {exc}") from None
    roofline = parts["hardware"]
    if not (roofline.bandwidth > 0 and roofline.flops > 0 and roofline.gpus >= 1):
        raise ValueError(f"{source}: hardware: expected bandwidth and flops > 0 and gpus >= 1")
    return CostModel(parts["shape"], roofline, parts["overhead_seconds"])


def save(path: str, cost: CostModel, about: dict[str, Any] | None = None) -> None:
    with open(path, "w") as out:
        json.dump(as_dict(cost, about), out, indent=2)
        out.write("\n")


def load(path: str) -> CostModel:
    """The cost model in the file ``ferry fit`` wrote at ``path``."""
    return from_dict(_read(path), path)


def measured(path: str) -> list[Measured]:
    """The steps ``ferry fit`` measured for the file at ``path`` (to fit them again, with others)."""
    try:
        return [Measured(tuple(q), tuple(c), float(s)) for q, c, s in _read(path)["about"]["measured"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: no measured steps ({type(exc).__name__}: {exc})") from None


def _read(path: str) -> Any:
    with open(path) as source:
        try:
            return json.load(source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
