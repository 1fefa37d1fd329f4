"""Every command the README, docs/, experiments/README.md and experiments/docs/ show still runs as
written: its script or module exists, its parser accepts the arguments (built without running
the script: tests/support/static_parser.py), ``make`` names a target of the Makefile and
``pytest`` a marker and paths that exist. A synopsis (``[--config FILE]``, ``KIND``, ``...``)
is checked for its sub-commands and flags only, and so is a sub-command named in prose
without the flags it requires (``python -m workers engine``)."""

from __future__ import annotations

import argparse
import functools
import re
import tomllib

import pytest

from tests.support.doc_commands import ROOT, Command, documented_commands
from tests.support.static_parser import parser_of

COMMANDS = documented_commands()
PLACEHOLDER = re.compile(r"^\[|^[A-Z][A-Z0-9_]*(?:[@=][A-Z0-9_]*)?\]?$")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


class Refused(Exception):
    """What argparse would have printed before exiting."""


@functools.cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), flags=re.M))


@functools.cache
def parser(module: str) -> argparse.ArgumentParser | None:
    """The module's parser; None for a script that reads no arguments."""
    path = ROOT / module.replace(".", "/")
    script = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
    assert script.is_file(), f"no module {module} in the repository"
    return parser_of(script, f"{module}.__main__" if path.is_dir() else module)


def program(words: list[str]) -> tuple[str, list[str]]:
    """The module a command runs (``make`` and ``pytest`` as themselves) and its arguments."""
    if words[0] == "ferry":
        module = PYPROJECT["project"]["scripts"]["ferry"].split(":")[0]
        return module, words[1:]
    if words[0] in ("make", "pytest"):
        return words[0], words[1:]
    if words[1] == "-m":
        return words[2], words[3:]
    script = ROOT / words[1]
    assert script.is_file(), f"no script {words[1]} in the repository"
    return ".".join(script.relative_to(ROOT).with_suffix("").parts), words[2:]


def check_make(arguments: list[str]) -> None:
    for target in (a for a in arguments if "=" not in a):
        assert target in make_targets(), f"make has no target {target!r}"


def check_pytest(arguments: list[str]) -> None:
    markers = {line.split(":")[0] for line in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    words = iter(arguments)
    for word in words:
        if word == "-m":
            used = set(re.findall(r"\w+", next(words))) - {"and", "or", "not"}
            assert used <= markers, f"no marker {sorted(used - markers)}"
        elif not word.startswith("-"):
            assert (ROOT / word.split("::")[0]).exists(), f"no test path {word}"


def check_synopsis(parser: argparse.ArgumentParser, arguments: list[str]) -> None:
    """Sub-commands named must exist, and every flag must be one of the (sub-)parser's."""
    for word in (w.strip("[]") for w in arguments):
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if word.startswith("--"):
            flags = [f for a in parser._actions for f in a.option_strings if f.startswith(word.split("=")[0])]
            assert flags, f"no flag {word}"
        elif subcommands and word and not word.startswith("-") and word != "...":
            if PLACEHOLDER.match(word):
                return  # the sub-command is left open (KIND): nothing further to check against
            assert word in subcommands[0].choices, f"no sub-command {word!r}"
            parser = subcommands[0].choices[word]


def parse(parser: argparse.ArgumentParser, arguments: list[str], monkeypatch) -> None:
    def refuse(self, message):
        raise Refused(message)

    def leave(self, status=0, message=None):
        if status:
            raise Refused(message)
        raise SystemExit(0)  # --help: accepted

    monkeypatch.setattr(argparse.ArgumentParser, "error", refuse)
    monkeypatch.setattr(argparse.ArgumentParser, "exit", leave)
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: None)
    try:
        parser.parse_args(arguments)
    except SystemExit:
        pass
    except Refused as refused:
        named = not any(a.startswith("-") for a in arguments) and "required" in str(refused)
        if not named:  # a sub-command named in prose ("python -m workers engine") need not be whole
            pytest.fail(f"the parser refuses it: {refused}")
        check_synopsis(parser, arguments)


def check(command: Command, monkeypatch) -> None:
    module, arguments = program(command.words)
    if module == "make":
        return check_make(arguments)
    if module == "pytest":
        return check_pytest(arguments)
    script = parser(module)
    if script is None:
        assert not arguments, f"{module} reads no arguments"
        return None
    if "|" in arguments:  # alternatives: "ferry reload | status | drain | weights"
        for alternative in " ".join(arguments).split("|"):
            check_synopsis(script, alternative.split()[:1])
        return None
    if "..." in arguments or any(PLACEHOLDER.match(a) for a in arguments):
        return check_synopsis(script, arguments)
    return parse(script, arguments, monkeypatch)


def test_the_documentation_shows_commands():
    assert len(COMMANDS) > 150
    assert {c.page for c in COMMANDS} >= {"README.md", "experiments/README.md", "docs/simulation.md"}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_a_documented_command_parses_as_written(command, monkeypatch):
    try:
        check(command, monkeypatch)
    except AssertionError as error:
        pytest.fail(f"{command}\n{error}")


def test_a_misspelt_flag_is_refused(monkeypatch):
    command = Command("-", 0, ".venv/bin/python -m experiments.burst --virtual --wrokers 8")
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --wrokers"):
        check(command, monkeypatch)
    synopsis = Command("-", 0, "ferry serve [--config FILE] [--hots H]")
    with pytest.raises(AssertionError, match="no flag --hots"):
        check(synopsis, monkeypatch)
