"""A request body decoded into its route's typed struct by msgspec (in C, in one pass), and
msgspec's complaint in ferry's words: the field by its path (``messages.0.content``), what was
expected, what came. Pure.

    body ──decode──> the route's struct        or InvalidRequest naming the field:
        unknown field           ``foo: not supported by this server, got 1`` (refused by name)
        missing field           ``messages.0.role: field required``
        wrong type or value     ``max_tokens: expected an integer >= 1, got "9"``

Every struct forbids unknown fields, so no field is accepted and dropped; a route's table of
``expected`` phrases words its fields (indexes written ``*``); the value shown is read from the
body again, on the error path only."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from gateway.wire.api import InvalidRequest, json_type, short, show

Expected = Mapping[str, "str | Callable[[object], str]"]
"""A route's words for its fields, by path (``messages.*.role``): what a field expects
(``one of 'user', 'assistant'``), or a function of the value that says the whole complaint."""


class Fields(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A part of a request: every field it may carry, and no other."""


_AT = r"(?: - at `\$(?P<path>[^`]*)`)?$"
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`" + _AT)
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`" + _AT)
_WRONG = re.compile(
    r"(?:Expected `(?P<type>[^`]+)`.*?|Invalid (?:enum )?value .*?|Number out of range)" + _AT
)
_STEPS = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
_TYPES = {"int": "an integer", "str": "a string", "float": "a number", "bool": "a boolean",
          "object": "an object", "array": "an array", "null": "null"}


def decode(decoder: msgspec.json.Decoder, body: bytes, expected: Expected) -> Any:
    """The body as the decoder's struct, or :class:`InvalidRequest` naming what is wrong."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(complaint(str(exc), body, expected)) from None
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(_unreadable(body, exc)) from None


def complaint(message: str, body: bytes, expected: Expected) -> str:
    """msgspec's ``message`` about ``body`` in ferry's words (see the module's docstring)."""
    if match := _UNKNOWN.match(message):
        path = (match["path"] or "") + "." + match["name"]
        return f"{_where(path)}: not supported by this server, got {show(_at(body, path))}"
    if match := _MISSING.match(message):
        return _where((match["path"] or "") + "." + match["name"]) + ": field required"
    if match := _WRONG.match(message):
        where, value = _where(match["path"] or ""), _at(body, match["path"] or "")
        if not where:
            return f"body: expected a JSON object, got {json_type(value)}"
        words = expected.get(re.sub(r"\.\d+(?=\.|$)", ".*", where)) or _phrase(match["type"])
        return f"{where}: {words(value) if callable(words) else f'expected {words}, got {show(value)}'}"
    return f"body: {short(message)}"


def _unreadable(body: bytes, exc: BaseException) -> str:
    """Bytes msgspec cannot read as JSON. The standard library reads one more kind, escaped lone
    surrogates (``"\\ud800"``), which no UTF-8 text can hold: said as such."""
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return f"body: expected a JSON object, got invalid JSON ({short(exc)})"
    return "body: expected valid Unicode text, got a lone surrogate escape"


def _where(path: str) -> str:
    """msgspec's path (``.messages[0].content``) as ferry names a field (``messages.0.content``)."""
    return ".".join(name or index for name, index in _STEPS.findall(path) if index != "...")


def _phrase(type_name: str | None) -> str:
    """msgspec's type (``str | array | null``) in words (``a string or an array``: where null is
    one choice, it is the field's absence, which the message need not offer)."""
    if type_name is None:
        return "another value"
    parts = [part.strip() for part in type_name.split("|")]
    return " or ".join(_TYPES.get(part, part) for part in parts if part != "null" or len(parts) == 1)


def _at(body: bytes, path: str) -> object:
    """The value at msgspec's ``path`` in ``body`` (read again: the error path alone pays for it);
    at ``[...]`` (some value of a map) the whole map."""
    try:
        value: Any = msgspec.json.decode(body)  # a JSON document: indexed below, any step may fail
    except (msgspec.DecodeError, RecursionError):
        return None
    for name, index in _STEPS.findall(path):
        if index == "...":
            break
        try:
            value = value[name] if name else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def unused(value: object) -> bool:
    """A value that says a feature is not used: absent, off, empty, ``none``, ``disabled``, or an
    object of such values (every route passes these for fields it refuses when used)."""
    if isinstance(value, dict):
        return (value.get("type") in ("none", "disabled", "text") and len(value) == 1) or all(
            unused(item) for item in value.values()
        )
    return value in (None, False, 0, "", [], "none")


def refuse_used(fields: object, names: tuple[str, ...]) -> None:
    """Raise :class:`InvalidRequest` for the first of ``names`` that ``fields`` uses: a field
    whose meaning ferry would drop, refused by name."""
    for name in names:
        value = getattr(fields, name)
        if value is not None and not unused(value):  # most are absent: no call for those
            raise InvalidRequest(f"{name}: not supported by this server, got {show(value)}")

