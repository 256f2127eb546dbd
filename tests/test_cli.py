"""End to end through the real `tmt` entry point, in subprocesses, in a temp directory."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import DEMO_CONFIG

STEPS = 40


def tmt(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transformer_mt", *args], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def test_train_then_translate_gives_the_validation_translations(tmp_path: Path):
    run = tmp_path / "runs" / "demo"
    result = tmt("train", "--config", str(DEMO_CONFIG), "--no-progress",
                 "--set", f"train.max_steps={STEPS}", "--set", "train.eval_every_steps=20",
                 "--set", "train.save_every_steps=20", "--set", "model.d_model=32", "--set", "model.d_ff=64",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("config.yaml", "tokenizer.json", "train.log", f"checkpoints/step_{STEPS:08d}.pt", "checkpoints/best.pt"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # Validation decoded every valid sentence (demo: eval_max_sentences 0); translating them
    # with the same checkpoint must give the same text.
    valid_src = (Path(DEMO_CONFIG).parent.parent / "transformer_mt/corpora/demo_en_it/valid.en").read_text("utf-8")
    validation = (run / "validation" / f"step_{STEPS:08d}.txt").read_text("utf-8")
    result = tmt("translate", "--checkpoint", str(run / "checkpoints" / f"step_{STEPS:08d}.pt"),
                 cwd=tmp_path, stdin=valid_src)
    assert result.returncode == 0, result.stderr
    assert result.stdout == validation

    # No --run: the newest run under ./runs; arguments instead of stdin; one line each.
    result = tmt("translate", "Good morning.", "Where is the station?", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2

    # Training again into the same directory refuses and keeps everything.
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    result = tmt("train", "--config", str(DEMO_CONFIG), cwd=tmp_path)
    assert result.returncode == 2
    assert "--resume" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_bad_config_exits_2_naming_every_key_without_a_traceback(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("name: x\ndata: {path: .}\ntrian: {}\nmodel: {d_model: 30, n_heads: 4}\n", encoding="utf-8")
    result = tmt("train", "--config", str(config), "--set", "train.lr=fast", cwd=tmp_path)
    assert result.returncode == 2
    assert "trian: unknown key (did you mean 'train'?)" in result.stderr
    assert "train.lr: expected a number" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_translate_without_any_run_exits_1_with_a_clear_message(tmp_path: Path):
    result = tmt("translate", "hello", cwd=tmp_path)
    assert result.returncode == 1
    assert "no trained run found" in result.stderr and "Traceback" not in result.stderr


def test_resume_without_a_checkpoint_exits_1(tmp_path: Path):
    result = tmt("train", "--config", str(DEMO_CONFIG), "--resume", "--run-dir", str(tmp_path / "empty"), cwd=tmp_path)
    assert result.returncode == 1
    assert "no checkpoint to resume from" in result.stderr
