"""The extras of pyproject.toml install together: the comet extra's transformers (through unbabel-comet)
and the hf and dev extras' own, at the transformers versions `tmt export --format hf` was tested with."""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.helpers import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# unbabel-comet 2.2.7's (the newest release's) requirement on transformers.
COMET_TRANSFORMERS = SpecifierSet(">=4.17,<5.0")
# The transformers versions tests/export/test_export_hf.py passed with (docs/guides/exporting.md names them).
TESTED = [Version(v) for v in ("4.52.4", "4.56.2", "4.57.6", "5.25.0")]


def extra_requirements(extra: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [Requirement(line) for line in project["optional-dependencies"][extra]]


def transformers_specifier(extra: str) -> SpecifierSet:
    specifiers = [r.specifier for r in extra_requirements(extra) if r.name == "transformers"]
    assert len(specifiers) == 1, f"the {extra} extra names transformers once"
    return specifiers[0]


@pytest.mark.parametrize("extra", ["hf", "dev"])
def test_the_extra_admits_a_transformers_that_comet_admits(extra: str):
    both = [version for version in TESTED if version in transformers_specifier(extra) and version in COMET_TRANSFORMERS]
    assert both, f"no tested transformers version fits both the {extra} extra and unbabel-comet ({COMET_TRANSFORMERS})"


@pytest.mark.parametrize("extra", ["hf", "dev"])
def test_the_extras_lower_bound_is_a_tested_version_and_admits_the_later_ones(extra: str):
    specifier = transformers_specifier(extra)
    lowest = min(Version(s.version) for s in specifier if s.operator == ">=")
    assert lowest in TESTED, f"the {extra} extra's lower bound {lowest} is not a tested version"
    assert all(version in specifier for version in TESTED if version >= lowest)


# What pip would otherwise install beside unbabel-comet (numpy < 2) and which then fails on import:
# pyarrow 26 (under datasets: `tmt train`) needs numpy 2; setuptools 82 has no pkg_resources (torchmetrics 0.10).
BROKEN_BESIDE_COMET = {"pyarrow": Version("26.0.1"), "setuptools": Version("82.0.1")}


def test_the_comet_extra_keeps_out_what_fails_beside_it():
    pins = {r.name: r.specifier for r in extra_requirements("comet")}
    for name, broken in BROKEN_BESIDE_COMET.items():
        assert name in pins and broken not in pins[name], f"the comet extra lets pip install {name} {broken}"
