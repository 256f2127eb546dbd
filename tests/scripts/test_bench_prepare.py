"""benchmarks/prepare.py runs tmt's preparation with the rule filters and OpusFilter on the same training
files, and ends in one JSON line. OpusFilter (its own environment, heavy dependencies) is stood in for by
a command that checks the config it is given as OpusFilter reads it and applies its duplicates step."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.scripts import benchmark_module

SCRIPT = REPO / "benchmarks" / "prepare.py"

# OpusFilter's step and filter names this harness relies on (opusfilter 3.3.1).
FAKE_OPUSFILTER = textwrap.dedent('''\
    import sys, yaml
    from pathlib import Path
    config = yaml.safe_load(open(sys.argv[1]))
    out = Path(config["common"]["output_directory"])
    assert config["common"]["default_n_jobs"] >= 1
    dedup, flt = config["steps"]
    assert dedup["type"] == "remove_duplicates" and flt["type"] == "filter"
    assert [next(iter(f)) for f in flt["parameters"]["filters"]] == [
        "LengthFilter", "LengthRatioFilter", "SimilarityFilter", "CharacterScoreFilter", "NonZeroNumeralsFilter",
        "HtmlTagFilter"]
    pairs = list(zip(*(open(p).read().splitlines() for p in dedup["parameters"]["inputs"])))
    unique = list(dict.fromkeys(pairs))
    for step, rows in ((dedup, unique), (flt, unique[1:])):  # the filter step drops one pair
        for i, name in enumerate(step["parameters"]["outputs"]):
            (out / name).write_text("".join(pair[i] + "\\n" for pair in rows))
    ''')


@pytest.fixture(scope="module")
def bench():
    with benchmark_module(SCRIPT, "bench_prepare") as module:
        yield module


def fake_opusfilter(folder: Path) -> Path:
    command = folder / "opusfilter"
    command.write_text(f"#!{sys.executable}\n" + FAKE_OPUSFILTER, encoding="utf-8")
    command.chmod(0o755)
    return command


def test_opusfilter_is_run_on_the_same_training_files_and_its_pairs_counted(bench, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.en").write_text("a b\nc d\na b\ne f\n", encoding="utf-8")
    (corpus / "train.it").write_text("x y\nz w\nx y\nv u\n", encoding="utf-8")
    seconds, kept = bench.run_opusfilter(str(fake_opusfilter(tmp_path)), corpus, tmp_path)
    assert seconds > 0 and kept == 2  # 3 distinct pairs, one dropped by the filter step


def test_a_failing_opusfilter_stops_the_benchmark_naming_its_log(bench, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    failing = tmp_path / "opusfilter"
    failing.write_text("#!/bin/sh\necho broken\nexit 3\n", encoding="utf-8")
    failing.chmod(0o755)
    with pytest.raises(SystemExit, match=r"failed \(exit 3\); see .*opusfilter\.log"):
        bench.run_opusfilter(str(failing), corpus, tmp_path)


@pytest.mark.skipif(sys.platform == "win32", reason="the benchmark runs on Linux or macOS")
def test_with_opusfilter_tmt_runs_the_rule_filters_and_both_are_in_the_json_line(bench, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench.main(["--pairs", "3000", "--work", str(tmp_path), "--opusfilter", str(fake_opusfilter(tmp_path))])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["overrides"][0] == "data.filters=[dedup,length,length_ratio,copies,characters,numbers,html]"
    train = (tmp_path / "synthetic-3000" / "train.en").read_text(encoding="utf-8").splitlines()
    # tmt's dedup normalises; the stand-in compares exact pairs: both keep at most the distinct pairs.
    assert 0 < result["train_pairs_kept"] <= len(set(train)) and result["opusfilter_pairs_kept"] > 0
    assert result["opusfilter_s"] >= 0 and result["read_vs_opusfilter"] >= 0  # the stand-in takes no time
    assert yaml.safe_load((next(tmp_path.glob("opusfilter-*")) / "config.yaml").read_text())["common"][
        "default_n_jobs"] == os.cpu_count()
