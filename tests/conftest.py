"""Shared fixtures: one torch thread (the CI machine's two cores are shared), a tiny corpus, a tiny
trained run (trained once per test process, copied for each test), `tmt` in-process; the integration
marker and the order the tests run in. Plain functions and constants are in helpers.py."""

from __future__ import annotations

import dis
import inspect
import shutil
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from tests.helpers import TINY_PAIRS, run_cli, tiny_config, tmt, write_corpus
from transformer_mt.config.loading import save_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory) -> Path:
    """A folder holding a tiny trained run at runs/tiny (trained through `tmt train`) and its config,
    trained once per test process. Never written to: tests take their own copy, `workdir`."""
    workdir = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(workdir / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    save_config(tiny_config(corpus, train={"max_steps": 4, "eval_every_steps": 2, "save_every_steps": 2,
                                           "log_every_steps": 1}), workdir / "tiny.yaml")
    result = tmt("train", "--config", "tiny.yaml", cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.fixture
def workdir(trained_workdir: Path, tmp_path_factory) -> Path:
    """This test's own copy of `trained_workdir`: the tiny run at runs/tiny and tiny.yaml (whose data path
    is the shared corpus, never written to)."""
    return Path(shutil.copytree(trained_workdir, tmp_path_factory.mktemp("workdir"), dirs_exist_ok=True))


@pytest.fixture
def tmt_here(monkeypatch, capsys):
    """`tmt(*args, cwd=, stdin=)` run in this process: the same exit code, stdout and stderr as the
    subprocess gives, without seconds of Python start-up and imports."""
    def call(*args: str, cwd: Path, stdin: str | None = None) -> CompletedProcess:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            try:
                code, out, err = run_cli(list(args), patch, capsys, cwd, None if stdin is None else stdin.encode())
            except SystemExit as exit_:  # refused while parsing the command line, as argparse refuses
                code, (out, err) = exit_.code, capsys.readouterr()
        return CompletedProcess(["tmt", *args], code, out, err)
    return call


# What makes a test slow: a `tmt` or other subprocess, or training, called by the test or by a fixture or
# helper of tests/ it uses. `python -m pytest -m "not integration"` runs the rest in under a minute.
SLOW_CALLS = {"tmt", "subprocess", "Popen", "train", "make_trainer", "Trainer"}


def calls_slow(*functions) -> bool:
    """Whether these functions, or the functions and classes of tests/ they name, name one of SLOW_CALLS."""
    todo, seen = [(f.__code__, f.__globals__) for f in functions if hasattr(f, "__code__")], set()
    while todo:
        code, namespace = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        names = {op.argval for op in dis.get_instructions(code) if op.opname == "LOAD_GLOBAL"}  # not attributes
        if SLOW_CALLS & names:
            return True
        todo += [(const, namespace) for const in code.co_consts if inspect.iscode(const)]  # nested functions
        for name in names:
            value = namespace.get(name)
            if getattr(value, "__module__", "").startswith("tests") and callable(value):
                methods = vars(value).values() if inspect.isclass(value) else [value]
                todo += [(m.__code__, m.__globals__) for m in methods if inspect.isfunction(m)]
    return False


def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values()]
        if calls_slow(getattr(item, "function", None), *fixtures):
            item.add_marker(pytest.mark.integration)
    # The longest first, then the other integration tests, the quick ones last to fill the workers' gaps:
    # a test of minutes started last would end the run alone.
    items.sort(key=lambda item: (not item.get_closest_marker("longest"), not item.get_closest_marker("integration")))
