"""Where each script lives: the benchmark harness in benchmarks/ (its shared helpers once, in
benchmarks/common.py), what users run on their data in scripts/, the docs checkers and the docs'
noisy corpus maker in tools/."""

import ast
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import PYTHONPATH, REPO

BENCHMARKS = REPO / "benchmarks"
HARNESS = ["batches.py", "decode.py", "finetune.py", "memory.py", "serve.py", "train.py", "goal_figures.py", "recipe_figures.py",
           "make_synthetic_corpus.py", "prepare.py", "filters.py"]


def files(folder: str) -> list[str]:
    return sorted(p.name for p in (REPO / folder).iterdir() if p.is_file())


def test_scripts_keeps_what_users_run_on_their_data_and_benchmarks_and_tools_the_rest():
    assert files("scripts") == ["multi30k_tokenize.py", "prepare_tatoeba.py", "source_use.py"]
    assert files("benchmarks") == sorted(HARNESS + ["common.py", "gpu_runbook.sh"])
    assert files("tools") == ["check_docs_site.sh", "check_serve_page.py", "count_assertions.py", "docs_reference.py",
                              "make_noisy_demo.py"]


def test_a_helper_two_benchmarks_use_is_written_once_in_common():
    defined: dict[str, set[str]] = {}
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, set()).add(path.name)
    for name in ("build_marian", "cpu_name", "print_profile", "synchronize", "build_run", "commit"):
        assert defined.get(name) == {"common.py"}, name
    twice = {name: where for name, where in defined.items() if len(where) > 1 and name not in ("main", "parse_args")}
    assert twice == {}


@pytest.mark.parametrize("name", HARNESS)
def test_each_benchmark_runs_from_any_folder(name: str, tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ")


def test_the_docs_site_builds_with_the_reference_hook_in_tools():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["hooks"] == ["tools/docs_reference.py"]
    assert (REPO / config["hooks"][0]).is_file()


def test_every_script_the_docs_name_is_where_they_say():
    named = set()
    pages = [REPO / "README.md", REPO / "mkdocs.yml", REPO / "pyproject.toml", REPO / ".ci" / "run",
             *(REPO / "docs").rglob("*.md"), *(REPO / "configs").glob("*.yaml")]
    for page in pages:
        named |= set(re.findall(r"(?<![\w/.])((?:scripts|benchmarks|tools)/[\w./-]+\.(?:py|sh))",
                                page.read_text(encoding="utf-8")))
    assert {"benchmarks/train.py", "benchmarks/gpu_runbook.sh", "tools/docs_reference.py"} <= named
    assert sorted(path for path in named if not (REPO / path).is_file()) == []
