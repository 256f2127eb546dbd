"""The package's shape: subpackages that read top to bottom, imports flowing one way between them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_mt"
# Each package may import the ones before it, never one after it.
LAYERS = ["core", "config", "data", "model", "runs", "export", "pretrained", "decode", "evaluate", "train", "serve", "cli"]


def imported_packages(path: Path) -> set[str]:
    """The subpackages a module imports, at the top or inside a function (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer_mt."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "transformer_mt":
            found.update(alias.name for alias in node.names if alias.name in LAYERS)
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("transformer_mt."))
    return found


def test_the_package_is_its_subpackages():
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith(("_", ".")) and p.name != "corpora")
    assert top == sorted(LAYERS)
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_each_package_says_in_one_sentence_what_it_owns():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))
        assert doc and doc.count(". ") == 0 and doc.endswith("."), layer


def test_imports_flow_one_way_between_packages():
    wrong = []
    for layer in LAYERS:
        allowed = set(LAYERS[: LAYERS.index(layer) + 1])
        for path in sorted((PACKAGE / layer).glob("*.py")):
            for package in sorted(imported_packages(path) - allowed):
                wrong.append(f"{layer}/{path.name} imports {package}")
    assert not wrong, "; ".join(wrong)


def test_no_module_imports_in_a_cycle():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer_mt."):
                module = node.module.removeprefix("transformer_mt.")
                if (PACKAGE / module.replace(".", "/")).is_dir():  # `from transformer_mt.data import corpus`
                    deps.update(f"{module}.{alias.name}" for alias in node.names)
                else:
                    deps.add(module)
        graph[name] = deps - {name}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import cycle: " + " -> ".join([*path[path.index(name):], name])
        if name in done:
            return
        for dependency in sorted(graph.get(name, ())):
            visit(dependency, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_module_imports_a_private_name_of_another():
    """What modules share is public (`cli/common.py`'s `load_translator`), never another module's `_helper`."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer_mt"):
                wrong += [f"{path.relative_to(PACKAGE)} imports {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert not wrong, "; ".join(wrong)
