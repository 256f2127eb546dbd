"""scripts/source_use.py: the loss with true and with swapped sources, from a run's checkpoint."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH, REPO, TINY_PAIRS, tiny_config, tmt
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import train

SCRIPT = REPO / "scripts" / "source_use.py"


def load_script():
    spec = importlib.util.spec_from_file_location("source_use", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_swapping_sources_costs_nothing_only_when_every_source_is_the_same(tiny_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    train(tiny_config(tiny_corpus, train={"max_steps": 6, "ema_decay": 0.5}), run, progress=False)
    checkpoint = run / "checkpoints" / "step_00000006.pt"
    script = load_script()
    src, tgt = [s for s, _ in TINY_PAIRS[:6]], [t for _, t in TINY_PAIRS[:6]]
    same = script.source_use(checkpoint, [src[0]] * 6, tgt)
    assert same["source_use"] == 0 and same["true"] > 0 and same["sentences"] == 6
    ema, trained = script.source_use(checkpoint, src, tgt), script.source_use(checkpoint, src, tgt, "trained")
    assert ema["shifted"] != ema["true"]
    assert ema["true"] != trained["true"]  # the EMA, which translate uses, is not the trained weights


def test_texts_of_different_lengths_are_one_line_and_an_exit_code(tmp_path: Path):
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(tmp_path / "x.pt"), "--src",
                             str(tmp_path / "a.en"), "--tgt", str(tmp_path / "a.de")], capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"source_use.py: {tmp_path / 'a.en'} and {tmp_path / 'a.de'} need "
                                                  "the same number of lines, at least 2 (got 2 and 1)"]


def nats_per_token(scored: str) -> float:
    """Mean negative log-likelihood per target token (EOS included) of `tmt score --format jsonl` lines."""
    pairs = [json.loads(line) for line in scored.splitlines()]
    return -sum(sum(pair["token_log_probs"]) for pair in pairs) / sum(len(pair["token_log_probs"]) for pair in pairs)


def test_the_losses_are_what_tmt_score_gives_the_true_and_the_shifted_sources(workdir: Path):
    checkpoint = sorted((workdir / "runs" / "tiny" / "checkpoints").glob("step_*.pt"))[-1]
    src, tgt = [s for s, _ in TINY_PAIRS[:6]], [t for _, t in TINY_PAIRS[:6]]
    files = {}
    for name, lines in (("true.en", src), ("shifted.en", src[1:] + src[:1]), ("ref.de", tgt)):
        files[name] = workdir / name
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--src", str(files["true.en"]),
                             "--tgt", str(files["ref.de"])], capture_output=True, text=True, cwd=workdir,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for key in ("true", "shifted"):
        scored = tmt("score", "--checkpoint", str(checkpoint), "--engine", "torch", "--format", "jsonl",
                     "--source", str(files[f"{key}.en"]), "--target", str(files["ref.de"]), cwd=workdir)
        assert scored.returncode == 0, scored.stderr
        assert figures[key] == pytest.approx(nats_per_token(scored.stdout), abs=1e-3), key
    assert figures["source_use"] == round(figures["shifted"] - figures["true"], 4)


def test_a_target_longer_than_the_model_scores_is_refused_naming_its_line(workdir: Path):
    checkpoint = sorted((workdir / "runs" / "tiny" / "checkpoints").glob("step_*.pt"))[-1]
    (workdir / "long.en").write_text("hello\nhello world\n", encoding="utf-8")
    (workdir / "long.de").write_text("hallo\n" + "hallo welt " * 60 + "\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--src",
                             str(workdir / "long.en"), "--tgt", str(workdir / "long.de")], capture_output=True,
                            text=True, cwd=workdir, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                                         "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("source_use.py: line 2: the target is "), result.stderr
    assert "this model scores at most 63" in lines[0]
