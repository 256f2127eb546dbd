"""Tests of the scripts in scripts/ (users run them on their data), benchmarks/ and tools/."""

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@contextlib.contextmanager
def benchmark_module(script: Path, name: str) -> Iterator[ModuleType]:
    """A script of benchmarks/ imported as module `name`, as `python benchmarks/X.py` runs it: its folder on
    sys.path (for common.py), registered in sys.modules (where @dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(script.parent))
        patch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        yield module
