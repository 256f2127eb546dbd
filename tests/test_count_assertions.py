"""tools/count_assertions.py: the checks lexically in each test, and which tests lost some."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("count_assertions", REPO / "tools" / "count_assertions.py")
count_assertions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(count_assertions)

TESTS = '''
import pytest
from pytest import raises

def helper():
    assert True  # not a test: not counted

def test_plain():
    assert 1
    assert 2, "message"

def test_raises_and_warns():
    with pytest.raises(ValueError):
        int("x")
    with raises(KeyError):
        {}["a"]
    with pytest.warns(UserWarning):
        pass
    def nested():
        assert False  # lexically inside the test: counted
    helper()

class TestGroup:
    def test_method(self):
        assert self

    def not_a_test(self):
        assert 0
'''


def test_each_test_gets_its_asserts_raises_and_warns(tmp_path: Path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(TESTS, encoding="utf-8")
    assert count_assertions.main(["--root", str(tmp_path), "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts == {"tests/test_x.py::test_plain": 2, "tests/test_x.py::test_raises_and_warns": 4,
                      "tests/test_x.py::TestGroup::test_method": 1}
    assert count_assertions.main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == ["7", "checks", "3", "tests", "total"]


def test_compare_names_the_tests_that_lost_checks_or_disappeared(tmp_path: Path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(TESTS, encoding="utf-8")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"tests/test_x.py::test_plain": 3, "tests/test_x.py::test_gone": 1,
                               "tests/test_x.py::test_raises_and_warns": 4}), encoding="utf-8")
    assert count_assertions.main(["--root", str(tmp_path), "--compare", str(old)]) == 1
    out = capsys.readouterr().out
    assert "dropped 3 -> 2: tests/test_x.py::test_plain" in out and "missing (had 1): tests/test_x.py::test_gone" in out
    assert "test_raises_and_warns" not in out
    old.write_text(json.dumps({"tests/test_x.py::test_plain": 2}), encoding="utf-8")
    assert count_assertions.main(["--root", str(tmp_path), "--compare", str(old)]) == 0
