"""The package's shape (docs/architecture.md): imports flow one way, modules and classes stay
readable in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_mt"
MAX_MODULE_LINES = 500
MAX_CORE_LINES = 400  # the loop and the model, where most changes land
MAX_CLASS_LINES = 250


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8")) for path in PACKAGE.glob("*.py")}


def imported_modules(tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules a module imports, at the top or inside a function (lazy imports count)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "transformer_mt":
                found.update(alias.name for alias in node.names if alias.name in known)
            elif node.module.startswith("transformer_mt."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("transformer_mt."))
    return found


def test_imports_flow_one_way():
    trees = modules()
    graph = {name: imported_modules(tree, set(trees)) - {name} for name, tree in trees.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import cycle: " + " -> ".join([*path[path.index(name):], name])
        if name in done:
            return
        for dependency in sorted(graph[name]):
            visit(dependency, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert "cli" not in set().union(*(graph[name] for name in graph if name != "__main__"))  # nothing imports cli


def test_modules_and_classes_are_readable_in_one_sitting():
    too_long = []
    for path in sorted(PACKAGE.glob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        limit = MAX_CORE_LINES if path.stem in ("training", "model") else MAX_MODULE_LINES
        if lines > limit:
            too_long.append(f"{path.name}: {lines} lines (at most {limit})")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.name}: class {node.name} has {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "; ".join(too_long)
