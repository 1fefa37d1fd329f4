"""A script's argparse parser, built without running the script or importing what it measures.

A module with a top-level ``build_parser()`` (``gateway.cli``, ``workers.__main__``) is imported
and asked for it. Any other script builds its parser inside a function (``main``, ``parse_args``):
only that function's parser statements run here (``ArgumentParser(...)``, ``add_argument``,
``add_subparsers``, ``add_parser``, ``set_defaults`` and helpers handed the parser), with their
help texts dropped and every name they use taken from the module's own top-level bindings, so an
experiment that imports torch at its top has its parser checked without torch."""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
from pathlib import Path

TEXT_KEYWORDS = {"help", "description", "epilog", "usage"}  # prose: nothing in them parses
NOT_BUILDING = {"parse_args", "parse_known_args", "parse_intermixed_args", "error", "exit", "print_help"}


def parser_of(path: Path, module: str) -> argparse.ArgumentParser | None:
    """The parser the script at ``path`` (importable as ``module``) builds; None if it reads no
    arguments (no function of it builds a parser, nor reads ``sys.argv``)."""
    tree = ast.parse(path.read_text())
    if any(isinstance(node, ast.FunctionDef) and node.name == "build_parser" for node in tree.body):
        return importlib.import_module(module).build_parser()
    function = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and _makes_parser(f)), None)
    if function is None:
        if any(isinstance(n, ast.Attribute) and n.attr == "argv" for n in ast.walk(tree)):
            raise LookupError(f"{path}: reads sys.argv without argparse")
        return None
    statements, root = _building(function)
    names = _Bindings(tree, path, module)
    code = ast.Module(body=statements, type_ignores=[])
    namespace = names.resolve_all(code)
    exec(compile(ast.fix_missing_locations(code), str(path), "exec"), namespace)
    return namespace[root]


def _makes_parser(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _called(n) == "ArgumentParser" for n in ast.walk(node))


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _building(function: ast.FunctionDef) -> tuple[list[ast.stmt], str]:
    """The statements of ``function`` that build its parser, prose dropped, and the parser's name."""
    tracked: list[str] = []
    kept: list[ast.stmt] = []
    for statement in function.body:
        value = getattr(statement, "value", None)
        if not isinstance(value, ast.Call) or isinstance(statement, ast.Return):
            continue
        on_tracked = isinstance(value.func, ast.Attribute) and getattr(value.func.value, "id", "") in tracked
        takes_tracked = any(getattr(arg, "id", "") in tracked for arg in value.args)
        targets = [t.id for t in getattr(statement, "targets", []) if isinstance(t, ast.Name)]
        if _called(value) == "ArgumentParser" or (on_tracked and _called(value) not in NOT_BUILDING):
            tracked += targets
        elif not takes_tracked:
            continue
        for call in (n for n in ast.walk(statement) if isinstance(n, ast.Call)):
            call.keywords = [k for k in call.keywords if k.arg not in TEXT_KEYWORDS]
        kept.append(statement)
    if not tracked:
        raise LookupError(f"{function.name}: no parser assigned to a name")
    return kept, tracked[0]


class _Bindings:
    """A module's top-level names, each evaluated only when a parser statement needs it."""

    def __init__(self, tree: ast.Module, path: Path, module: str):
        self.path, self.package = path, module.rpartition(".")[0]
        self.values: dict[str, object] = {"__file__": str(path), "__doc__": ast.get_docstring(tree) or ""}
        self.nodes: dict[str, ast.stmt] = {}
        for node in tree.body:
            for name in _bound(node):
                self.nodes.setdefault(name, node)

    def resolve_all(self, node: ast.AST) -> dict[str, object]:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        namespace: dict[str, object] = {"__builtins__": builtins}
        namespace.update((name, self.value(name)) for name in names if self.known(name))
        return namespace

    def known(self, name: str) -> bool:
        return name in self.values or name in self.nodes

    def value(self, name: str) -> object:
        if name not in self.values:
            self.values[name] = self._evaluate(name, self.nodes[name])
        return self.values[name]

    def _evaluate(self, name: str, node: ast.stmt) -> object:
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
            return importlib.import_module(alias.name if alias.asname else name)
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            source = "." * node.level + (node.module or "")
            return getattr(importlib.import_module(source, self.package or None), alias.name)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            expression = ast.Expression(node.value)
            return eval(compile(expression, str(self.path), "eval"), self.resolve_all(expression))
        namespace = self.resolve_all(node)  # a def or a class: run it where its names are bound
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(self.path), "exec"), namespace)
        return namespace[name]


def _bound(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    return []
