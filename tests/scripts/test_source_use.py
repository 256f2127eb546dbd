"""scripts/source_use.py: the loss with true and with swapped sources, from a run's checkpoint."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, TINY_PAIRS, tiny_config
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
