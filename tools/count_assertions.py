"""Count the checks of each test: `assert` statements, `pytest.raises` and `pytest.warns` calls
lexically inside each test function (helpers it calls are not followed).

    python tools/count_assertions.py [PATHS...]            total and per-file counts
    python tools/count_assertions.py --json > counts.json   {test id: count}
    python tools/count_assertions.py --compare old.json     tests whose count dropped or that are gone

A test id is pytest's node id without parameters: `tests/x/test_y.py::TestClass::test_name`.
Exit status of --compare: 1 when a test lost checks or disappeared, else 0.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

CHECKS = {"raises", "warns"}


def is_check(node: ast.AST) -> bool:
    """`assert ...`, or a call of `pytest.raises`/`pytest.warns` (also imported bare: `raises(...)`)."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in CHECKS and isinstance(func.value, ast.Name):
            return func.value.id == "pytest"
        if isinstance(func, ast.Name):
            return func.id in CHECKS
    return False


def count_checks(function: ast.AST) -> int:
    return sum(is_check(node) for node in ast.walk(function))


def tests_in(path: Path, root: Path) -> dict[str, int]:
    """{test id: checks} of one test file: module-level `test_*` functions and `test_*` methods of `Test*` classes."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    prefix = path.resolve().relative_to(root).as_posix()
    counts: dict[str, int] = {}

    def visit(body, scope: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                counts[f"{scope}::{node.name}"] = count_checks(node)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{scope}::{node.name}")

    visit(tree.body, prefix)
    return counts


def collect(paths: list[Path], root: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        files = [path] if path.is_file() else sorted(path.rglob("test_*.py")) + sorted(path.rglob("*_test.py"))
        for file in files:
            counts.update(tests_in(file, root))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="test files or folders (default: tests/)")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the folder test ids are relative to")
    parser.add_argument("--json", action="store_true", help="print {test id: count} as JSON")
    parser.add_argument("--compare", type=Path, metavar="OLD.json", help="list tests that lost checks since OLD.json")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    counts = collect(args.paths or [root / "tests"], root)

    if args.json:
        json.dump(counts, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    if args.compare:
        old = json.loads(args.compare.read_text(encoding="utf-8"))
        gone = sorted(set(old) - set(counts))
        dropped = sorted(t for t in old if t in counts and counts[t] < old[t])
        for test in dropped:
            print(f"dropped {old[test]} -> {counts[test]}: {test}")
        for test in gone:
            print(f"missing (had {old[test]}): {test}")
        print(f"{len(old)} tests, {sum(old.values())} checks before; {len(counts)} tests, "
              f"{sum(counts.values())} checks now; {len(dropped)} dropped, {len(gone)} missing")
        return 1 if dropped or gone else 0
    per_file: dict[str, list[int]] = {}
    for test, n in counts.items():
        tally = per_file.setdefault(test.split("::")[0], [0, 0])
        tally[0] += 1
        tally[1] += n
    for file, (tests, checks) in sorted(per_file.items()):
        print(f"{checks:6d} checks {tests:5d} tests  {file}")
    print(f"{sum(counts.values()):6d} checks {len(counts):5d} tests  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
