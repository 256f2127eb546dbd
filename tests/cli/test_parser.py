"""The command line's grammar: each command module declares its own subcommand beside its `run_*`,
`cli.parser` puts them together in order, and reading the grammar imports nothing heavy."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH
from transformer_mt.cli.parser import build_parser

CLI = Path(__file__).resolve().parents[2] / "transformer_mt" / "cli"
# Each command module and the subcommands it declares, in `tmt --help`'s order.
DECLARED = {"train": ["train"], "data": ["data"], "translate": ["translate", "evaluate"], "score": ["score"],
            "compare": ["compare"], "export": ["export"], "import_model": ["import"], "runs": ["runs"], "average": ["average"],
            "serve": ["serve"]}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("module", DECLARED)
def test_each_command_module_declares_its_own_subcommands(module: str, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    declared = importlib.import_module(f"transformer_mt.cli.{module}")
    parser = argparse.ArgumentParser(prog="tmt")
    commands = parser.add_subparsers()
    for name in dir(declared):  # add_parser, and translate.py's add_evaluate_parser
        if name.startswith("add_") and name.endswith("_parser"):
            getattr(declared, name)(commands)
    assert sorted(subcommands(parser)) == sorted(DECLARED[module])
    whole = subcommands(build_parser())
    for name, command in subcommands(parser).items():  # the very parser tmt uses: declared in one place
        assert command.format_help() == whole[name].format_help(), name


def test_the_parser_puts_every_command_module_together_in_order():
    assert list(subcommands(build_parser())) == [name for names in DECLARED.values() for name in names]


def test_reading_the_grammar_imports_no_heavy_package(tmp_path: Path):
    """`tmt COMMAND --help`, a config mistake and a cached translation start in a fraction of a second:
    the command modules import torch, datasets, fastapi or transformers only inside their `run_*`."""
    heavy = ["torch", "datasets", "fastapi", "uvicorn", "pydantic", "transformers", "sacrebleu", "ctranslate2"]
    modules = ", ".join(f"transformer_mt.cli.{path.stem}" for path in sorted(CLI.glob("*.py")))
    code = (f"import sys, {modules}\n"
            "from transformer_mt.cli.parser import build_parser\n"
            "parser = build_parser()\n"
            "for argv in (['train', '--config', 'c.yaml'], ['translate', 'x'], ['serve'], ['evaluate'],\n"
            "             ['score'], ['compare', 'a', 'b'], ['export', '--run', 'r', '--output', 'o'], ['runs'],\n"
            "             ['average', '--run', 'r'], ['data', '--config', 'c.yaml'], ['import', 'm', '--run-dir', 'r']):\n"
            "    parser.parse_args(argv)\n"
            f"print([name for name in {heavy!r} if name in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_run_train_reads_top_to_bottom():
    """Its clean-ups (the process group, the run's lock, taking a new run back, train.log's last
    record) are context managers on one stack, not `try` blocks nested three deep."""
    tree = ast.parse((CLI / "train.py").read_text(encoding="utf-8"))
    run_train = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run_train")
    assert not [node.lineno for node in ast.walk(run_train) if isinstance(node, ast.Try)]
