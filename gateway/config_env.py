"""``FERRY_*`` environment variables over a configuration file's fields: pure.

    FERRY_SERVER__PORT=9000             [server] port = 9000
    FERRY_LIMITS__REDIS_URL=redis://r:6379/0
    FERRY_MODELS__0__MAX_BATCH=32       the first [[models]] table's max_batch
    FERRY_KEYS__1__KEY=sk-...           a secret kept out of the file
    FERRY_ALIASES__CANARY='{ "m@1" = 9, "m@2" = 1 }'

A name is the field's path, its parts joined by ``__`` (any case); a value is read as TOML
(``9000``, ``true``, ``["a", "b"]``), else taken as a string. The file is checked after the
variables are applied, exactly as it is without them, and an error names the variable."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping

PREFIX = "FERRY_"


def overrides(environ: Mapping[str, str]) -> list[tuple[str, list[str], object]]:
    """(variable, path, value) of each ``FERRY_`` variable that names a field."""
    found = []
    for name, raw in sorted(environ.items()):
        if name.startswith(PREFIX) and "__" in name:
            path = [part.lower() for part in name[len(PREFIX):].split("__")]
            found.append((name, path, _value(raw)))
    return found


def apply(document: dict, environ: Mapping[str, str]) -> dict[str, str]:
    """Set each variable's field in ``document`` (a parsed TOML file); the dotted place each set,
    by the variable's name, for an error to name it. ``ValueError`` for a variable that names
    no place a file could hold (a list index past the end, a field of a value)."""
    placed = {}
    for name, path, value in overrides(environ):
        table: object = document
        for depth, part in enumerate(path[:-1]):
            table = _step(table, part, name, path[: depth + 1])
        if not isinstance(table, dict):
            raise ValueError(f"{name}: {_where(path[:-1])} is not a table")
        table[path[-1]] = value
        placed[name] = _where(path)
    return placed


def _step(table: object, part: str, name: str, path: list[str]) -> object:
    if isinstance(table, list):
        if not part.isdigit() or int(part) >= len(table):
            raise ValueError(f"{name}: {_where(path)}: no such table (the file has {len(table)})")
        return table[int(part)]
    if not isinstance(table, dict):
        raise ValueError(f"{name}: {_where(path[:-1])} is not a table")
    return table.setdefault(part, {})


def _where(path: list[str]) -> str:
    """A path as the config's errors write it: ``models[0].max_batch``."""
    return "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in path).lstrip(".")


def _value(raw: str) -> object:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw
