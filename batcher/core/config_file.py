"""The core's tables of the configuration file, and the conversion of any one table into its
frozen dataclass (the gateway's :mod:`gateway.config` reads the whole file with it).

The tiers (in priority order) and the models (:mod:`batcher.core.config`, a class per ``mode``) are
the core's; :func:`build_table` turns one TOML table into one of these dataclasses, or any other,
and adds where a bad value came from, so an error reads ``models[1].max_batch: expected
1..1024, got 0``. msgspec converts each table into its dataclass (strictly: no bool for an int,
no string for a number), so the types are the dataclasses' own annotations, read by one kept
library; each class then checks its values itself.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from batcher.core.config import ModelConfig, require
from batcher.core.modes import MODES, config_class

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclasses.dataclass(frozen=True, slots=True)
class TierConfig:
    """A tier; a queued request of it that waits past ``wait_budget_ms`` gets 529 (Overloaded).
    ``tpot_target_ms`` is the time per output token its continuous-mode requests are promised (0:
    none): an engine runs no more sequences together than keep its steps within it
    (docs/admission.md, "TPOT targets")."""

    name: str
    wait_budget_ms: int = 1000
    tpot_target_ms: float = 0.0

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "a tier name", self.name)
        require(self.wait_budget_ms > 0, "wait_budget_ms", "milliseconds > 0", self.wait_budget_ms)
        require(0 <= self.tpot_target_ms < math.inf, "tpot_target_ms", "milliseconds >= 0 (0: none)",
                self.tpot_target_ms)


T = TypeVar("T", bound="DataclassInstance")


def model_table(table: object, where: str, base: str = ".") -> ModelConfig:
    """A model table, built and checked by the class of its ``mode``, its paths relative to the
    configuration file resolved against ``base`` (:meth:`ModelConfig.located`)."""
    mode = table.get("mode", "fixed") if isinstance(table, dict) else None
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{where}.mode: expected one of {sorted(MODES)}, got {mode!r}")
    model = build_table(config_class(mode), table, where)
    try:
        return model.located(base)
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None


def build_table(cls: type[T], table: object, where: str) -> T:
    """One dataclass from one TOML table, converted by msgspec (strictly: no bool for an int, no
    string for a number) and checked by the class itself; unknown fields, wrong types and bad
    values all name the place they came from."""
    if not isinstance(table, dict):
        # a config mistake is a ValueError, whatever its kind: the loader names where it came from
        raise ValueError(f"{where}: expected a table, got {table!r}")
    fields = sorted(field.name for field in dataclasses.fields(cls))
    for name in table:
        if name not in fields:
            raise ValueError(f"{where}: unknown field {name!r}; expected one of {fields}")
    try:
        return msgspec.convert(table, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(_complaint(exc, table, where)) from None


_WRONG_TYPE = re.compile(r"Expected `(?P<expected>.+?)`, got `.+?` - at `\$(?P<path>.*)`")
_MISSING = re.compile(r"Object missing required field `(?P<name>.+)`")
_TYPE_NAMES = {"array": "a list", "object": "a table"}


def _complaint(exc: msgspec.ValidationError, table: dict[str, object], where: str) -> str:
    """msgspec's account of a bad table in the file's words: ``models[0].workers: expected int,
    got True``; a class's own check (a ``ValueError`` in ``__post_init__``) already names its field."""
    if isinstance(exc.__cause__, ValueError):
        return f"{where}.{exc.__cause__}"
    if wrong := _WRONG_TYPE.fullmatch(str(exc)):
        expected, path = _TYPE_NAMES.get(wrong["expected"], wrong["expected"]), wrong["path"]
        return f"{where}{path}: expected {expected}, got {_value_at(table, path)!r}"
    if missing := _MISSING.fullmatch(str(exc)):
        return f"{where}: missing field {missing['name']!r}"
    return f"{where}: {exc}"


def _value_at(table: dict[str, object], path: str) -> object:
    """The value at a msgspec path (``.worker[1]``) inside ``table``; at ``[...]`` (some value of
    a map, msgspec does not say which) the whole map."""
    value: Any = table  # TOML: tables and lists all the way down the path msgspec gives
    for name, index in re.findall(r"\.(\w+)|\[(\d+|\.\.\.)\]", path):
        if index == "...":
            break
        value = value[name] if name else value[int(index)]
    return value


