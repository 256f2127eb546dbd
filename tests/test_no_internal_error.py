"""No input makes tmt fail with an internal error: random config files, `--set` overrides and
command lines (hypothesis) end in a result or in one `tmt: error:` line with exit 1 or 2.

No training happens: `train` stops where training would begin, `data` where the corpus would be read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers import DEMO_CONFIG  # noqa: E402
from transformer_mt.cli import main as cli  # noqa: E402
from transformer_mt.config.loading import load_config
from transformer_mt.config.schema import Config  # noqa: E402
from transformer_mt.core.errors import DataError, TmtError  # noqa: E402
from transformer_mt.train.state import TrainState  # noqa: E402

SECTIONS = {field.name: field.type for field in dataclasses.fields(Config)}
FIELDS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in
          {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)
           if f.default_factory is not dataclasses.MISSING}.items()}
DOTTED = [f"{section}.{key}" for section, keys in FIELDS.items() for key in keys] + list(SECTIONS)

numbers_as_text = st.sampled_from(["1e-3", "3e-4", "12", "-5", "0", "nan", "inf", "-inf", "1_000", "0x10", "1.5",
                                   "true", "null", "~", "[1, 2]", "{a: 1}", "''", "auto", "bf16", "10000000000000"])
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | numbers_as_text)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=8)
keys = st.sampled_from(DOTTED) | st.text(max_size=10)


BASE = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))


@st.composite
def raw_configs(draw) -> object:
    """A config document: the demo's with some keys set to values of any type (which reach the
    checks of a config that otherwise holds together), or the real sections and keys with
    values of any type and some junk, or not even a mapping."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(values)
    if kind <= 5:
        raw = {section: dict(body) if isinstance(body, dict) else body for section, body in BASE.items()}
        for key in draw(st.lists(st.sampled_from(DOTTED), min_size=1, max_size=3)):
            section, _, field = key.partition(".")
            if field and isinstance(raw.get(section), dict):
                raw[section][field] = draw(values | st.integers(-3, 70000) | st.floats(-2, 2))
            else:
                raw[section] = draw(values)
        return raw
    raw = {}
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)) | st.text(max_size=6), max_size=6)):
        if section in FIELDS and draw(st.booleans()):
            raw[section] = {key: draw(values) for key in draw(st.lists(st.sampled_from(FIELDS[section]) |
                                                                       st.text(max_size=6), max_size=5))}
        else:
            raw[section] = draw(values)
    return raw


overrides = st.lists(st.builds(lambda key, sep, value: f"{key}{sep}{value}", keys, st.sampled_from(["=", "", "=="]),
                               numbers_as_text | st.text(max_size=10)), max_size=4)


def dump(raw: object) -> str:
    try:
        return yaml.safe_dump(raw, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return repr(raw)  # not YAML-representable: the text itself is the junk


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=raw_configs(), sets=overrides, prefix=st.sampled_from(["", "name: x\n", "\ufeff", "%YAML 1.1\n---\n"]))
def test_any_config_file_and_overrides_load_or_raise_a_named_error(raw, sets, prefix):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(prefix + dump(raw), encoding="utf-8")
        try:
            load_config(path, sets)
        except TmtError as err:
            assert str(err).strip(), "an error without a message"


def _stop_before_training(*args, **kwargs) -> TrainState:
    return TrainState()


def _stop_before_reading_data(*args, **kwargs):
    raise DataError("stopped before reading the data (test)")


PATHS = ["config.yaml", "missing.yaml", ".", "runs", "runs/x", "out.txt", "-", "", "a/b/c", "\udcff", "good.yaml"]
OPTIONS = {
    "train": ["--config", "--run-dir", "--set", "--resume", "--overwrite", "--quiet"],
    "data": ["--config", "--run-dir", "--set", "--quiet"],
    "translate": ["--run", "--checkpoint", "--input", "--output", "--show-attention", "--attention-layer", "--beam",
                  "--length-penalty", "--device", "--quiet", "--alignments", "--alignment-layer", "--glossary",
                  "--glossary-case", "--input-format"],
    "evaluate": ["--run", "--checkpoint", "--split", "--src", "--ref", "--tokenize", "--output", "--beam",
                 "--length-penalty", "--device", "--bootstrap", "--comet", "--no-diagnostics", "--glossary"],
    "score": ["--run", "--checkpoint", "--source", "--target", "--format", "--output", "--engine", "--device",
              "--alignments", "--alignment-layer"],
    "compare": ["--ref", "--format", "--tokenize", "--bootstrap", "--trials", "--examples"],
    "export": ["--format", "--run", "--output", "--checkpoint", "--quantization"],
    "runs": ["--dir"],
    "average": ["--run", "--last", "--output"],
    "import": ["--run-dir"],  # its MODEL: a stray word (a Hub id is looked up offline)
    "serve": ["--run", "--checkpoint", "--port", "--max-wait-ms", "--batch-tokens", "--max-sentences", "--max-beam",
              "--beam", "--glossary"],  # no --host: a name looked up in DNS could wait
}
arguments = st.sampled_from(PATHS) | numbers_as_text | st.text(max_size=8) | st.sampled_from(DOTTED).map(
    lambda key: f"{key}=1")


@st.composite
def command_lines(draw) -> list[str]:
    command = draw(st.sampled_from(list(OPTIONS)) | st.text(max_size=6))
    argv = [command]
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 4)) == 0:
            argv.append(draw(arguments))  # a stray word
        else:
            argv += [draw(st.sampled_from(OPTIONS.get(command, ["--help"]))), draw(arguments)]
    return argv


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines(), raw=raw_configs(), stdin=st.binary(max_size=20))
def test_any_command_line_ends_in_a_result_or_one_error_line(argv, raw, stdin):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        Path("config.yaml").write_text(dump(raw), encoding="utf-8")
        Path("good.yaml").write_text(DEMO_CONFIG.read_text(encoding="utf-8").replace(
            "path: ", "path: " + str(DEMO_CONFIG.parent) + "/", 1), encoding="utf-8")
        monkeypatch.setattr("transformer_mt.train.trainer.train", _stop_before_training)
        monkeypatch.setattr("transformer_mt.train.preparation.prepare_data", _stop_before_reading_data)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                try:
                    code = cli.main(argv)
                except SystemExit as exit_:  # argparse: --help, or bad arguments
                    code = exit_.code
        finally:
            root.handlers, root.level = handlers, level
    text = err.getvalue()
    assert "internal error" not in text and "Traceback" not in text, (argv, text)
    assert code in (0, 1, 2), (argv, code, text)
    if code:
        errors = [line for line in text.splitlines() if line.startswith("tmt") and ": error:" in line]
        assert len(errors) == 1, (argv, text)
