"""benchmarks/decode.py runs with or without its comparison engines (CTranslate2, Hugging Face
Marian) and ends in one JSON line, so the GPU runbook's `decode` stage cannot break on the machine;
benchmarks/gpu_runbook.sh lists that stage."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.scripts import benchmark_module

SCRIPT = REPO / "benchmarks" / "decode.py"
SMALL = ["--n-sentences", "64", "--n-batch1", "8", "--gen-tokens", "10", "--batch-sizes", "1,32"]


@pytest.fixture(scope="module")
def bench():
    with benchmark_module(SCRIPT, "bench_decode") as module:
        yield module


def run(bench, args: list[str], capsys) -> tuple[list[str], dict]:
    bench.main(SMALL + args)
    lines = capsys.readouterr().out.splitlines()
    return lines, json.loads(lines[-1])


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_without_ctranslate2_or_transformers_installed_tmt_is_timed_and_their_figures_are_null(bench, capsys,
                                                                                              monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    lines, result = run(bench, ["--test-beam", "2", "--test-sentences", "16"], capsys)
    assert "# ct2: left out, ctranslate2 is not installed (pip install ctranslate2); its figures are null" in lines
    assert "# hf_marian: left out, transformers is not installed (pip install transformers); its figures are null" in lines
    for key in ("cached_tokens_per_s", "uncached_tokens_per_s", "beam4_tokens_per_s"):
        assert result[key] > 0 and result["by_batch_size"]["1"][key] > 0
    # tmt translate runs on CTranslate2 here, so it is left out with it.
    for key in ("ct2_tokens_per_s", "tmt_vs_ct2", "tmt_beam4_vs_ct2", "ct2_int8_tokens_per_s", "tmt_int8_vs_ct2_int8",
                "translate_tokens_per_s", "int8_tokens_per_s", "torch_vs_ct2", "tmt_vs_hf_marian_greedy",
                "tmt_vs_hf_marian_beam4", "ctranslate2", "transformers", "same_greedy_output"):
        assert result[key] is None, key
    figure = next(json.loads(line) for line in lines if line.startswith('{"figure"'))
    assert figure["figure"] == "decode_16_beam2_s" and figure["sentences"] == 16 and figure["seconds"] > 0
    assert result["decode_16_beam2_s"] == figure["seconds"]
    assert all(engine["sentences"] for engine in result["by_batch_size"].values())


@pytest.mark.skipif(not installed("ctranslate2"), reason="ctranslate2 is not installed (the `bench` extra)")
def test_with_ctranslate2_its_ratios_are_measured_and_both_run_the_same_weights(bench, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    _, result = run(bench, [], capsys)
    # tmt translate (text in, text out, on its CTranslate2 engine) against raw CTranslate2, and tmt's torch search.
    assert result["tmt_vs_ct2"] > 0 and result["tmt_beam4_vs_ct2"] > 0 and result["ctranslate2"]
    assert result["torch_vs_ct2"] > 0 and result["torch_beam4_vs_ct2"] > 0
    assert result["by_batch_size"]["32"]["sentences"]["tmt translate greedy"] == 64
    assert result["tmt_int8_vs_ct2_int8"] > 0 and result["by_batch_size"]["1"]["tmt_int8_vs_ct2_int8"] > 0
    agree, compared = map(int, result["same_greedy_output"].split("/"))
    assert compared == 32 and agree >= 30  # the same weights: greedy outputs agree (a near tie may split one)


@pytest.mark.skipif(not installed("transformers"), reason="transformers is not installed (on the GPU image it is)")
def test_with_transformers_marian_generates_as_many_tokens_and_its_ratios_are_measured(bench, capsys):
    _, result = run(bench, ["--without", "ct2"], capsys)
    assert result["tmt_vs_hf_marian_greedy"] > 0 and result["tmt_vs_hf_marian_beam4"] > 0
    assert result["ct2_tokens_per_s"] is None  # --without
    sentences = result["by_batch_size"]["32"]["sentences"]
    assert sentences["hf_marian greedy"] == sentences["tmt torch greedy, cached"] == 64


def test_no_int8_leaves_the_int8_engines_out(bench, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    lines, result = run(bench, ["--no-int8", "--batch-sizes", "32"], capsys)
    assert result["int8_tokens_per_s"] is None and result["tmt_int8_vs_ct2_int8"] is None
    assert not any("int8" in line for line in lines[:-1])


def test_an_unknown_engine_to_leave_out_is_one_clear_line(bench):
    with pytest.raises(SystemExit, match=r"--without: unknown engine\(s\) ct3 \(choose from ct2, hf_marian\)"):
        bench.main(SMALL + ["--without", "ct3"])


def test_the_gpu_runbook_usage_lists_every_stage_it_accepts(tmp_path: Path):
    script = SCRIPT.parent / "gpu_runbook.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert usage.returncode == 2
    accepted = re.search(r"^\s+(check\|[a-z0-9|-]+)\) ;;$", script.read_text(), re.MULTILINE).group(1).split("|")
    assert "decode" in accepted
    for stage in ["prepare", *accepted]:
        assert re.search(rf"^#   {re.escape(stage)} +\S", usage.stdout, re.MULTILINE), stage
    unknown = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown stage 'nope' (bench, bench-large, bench-more, decode, finetune, profile," in unknown.stderr
