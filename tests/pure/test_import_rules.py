"""The import rules of docs/architecture.md ("What each package may import"), read from its tables
and held against the import graph of batcher, gateway, workers and tests: a new edge that breaks a layer
fails here, naming the file, the line and the rule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = ("batcher", "gateway", "workers", "tests")
BACKENDS = ("batcher.fixed.batcher", "batcher.fixed.pool", "batcher.fixed.mode", "batcher.continuous.pool",
            "batcher.continuous.mode")


def tables() -> list[list[list[set[str]]]]:
    """The tables of the section, each a list of rows, each row its cells' backticked names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## What each package may import", 1)[1].split("\n## ", 1)[0]
    found: list[list[list[set[str]]]] = []
    rows: list[list[set[str]]] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            cells = line.strip("|").split("|")
            if not set(cells[0].strip()) <= {"-"}:
                rows.append([set(re.findall(r"`([\w.]+)`", cell)) for cell in cells])
        elif rows:
            found.append(rows[1:])  # the header row names the columns
            rows = []
    return found


def layer_rules() -> dict[str, tuple[set[str], set[str]]]:
    """package -> (the ferry packages it may import, the packages it never imports)."""
    layers, _ = tables()
    return {next(iter(package)): (allowed, never) for package, allowed, never in layers}


def pure_rules() -> tuple[set[str], set[str]]:
    """The pure cores, and what none of them imports."""
    _, pure = tables()
    ((cores, never),) = pure
    return cores, never


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    paths = (path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")))
    return {module_name(path): path for path in paths}


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module imported, the name it imports from it or '') of every absolute import."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def within(name: str, packages: set[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def row_of(module: str, rules: dict[str, tuple[set[str], set[str]]]) -> str:
    return max((package for package in rules if within(module, {package})), key=len)


def breaks(imported: str, name: str, allowed: set[str], never: set[str]) -> str | None:
    """Why importing ``imported`` (``name`` from it) breaks a row, or None."""
    full = f"{imported}.{name}" if name else imported
    if within(imported, never) or within(full, never):
        return f"never imports {imported}"
    ferry = imported.split(".")[0] in (*PACKAGES, "experiments")
    if ferry and not (within(imported, allowed) or within(full, allowed)):
        return f"may import only {', '.join(sorted(allowed))} of ferry's packages, not {full}"
    return None


def test_every_module_follows_the_rule_of_its_layer():
    rules = layer_rules()
    broken = []
    for module, path in sources().items():
        row = row_of(module, rules)
        allowed, never = rules[row]
        for line, imported, name in imports(path):
            why = breaks(imported, name, allowed, never)
            if why:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {row} {why}")
    assert broken == []


def test_the_pure_cores_import_no_event_loop_and_do_no_io():
    cores, never = pure_rules()
    modules = sources()
    assert cores <= modules.keys(), f"the table names modules that do not exist: {cores - modules.keys()}"
    broken = [f"{module}:{line} imports {imported}" for module in sorted(cores)
              for line, imported, _ in imports(modules[module]) if within(imported, never)]
    assert broken == []


def closure(start: str, modules: dict[str, Path]) -> set[str]:
    """Every ferry module that importing ``start`` imports, through top-level imports."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in modules:
            continue
        seen.add(module)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        tree = ast.parse(modules[module].read_text())
        for node in tree.body:  # top level only: an import inside a function runs when it is called
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                todo += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        todo += parents
    return seen


def test_loading_a_config_file_imports_no_backend():
    modules = sources()
    loaded = closure("gateway.config", modules) | closure("batcher.fixed.config", modules)
    loaded |= closure("batcher.continuous.config", modules)
    assert loaded & set(BACKENDS) == set()
    assert not any(within(module, {"trio"}) for module in loaded)


@pytest.mark.parametrize(("module", "imported", "name", "why"), [
    ("batcher.core.fleet", "gateway.wire.api", "", "never imports gateway.wire.api"),
    ("batcher.continuous.pool", "workers.engine.block_manager", "cdiv", "may import only"),
    ("gateway.text.chat", "workers", "convert", "never imports workers"),
    ("workers.engine.engine", "trio", "", "never imports trio"),
])
def test_an_edge_across_a_layer_is_named_with_its_rule(module, imported, name, why):
    rules = layer_rules()
    allowed, never = rules[row_of(module, rules)]
    assert why in (breaks(imported, name, allowed, never) or "")
