"""One writer per run directory: a second `tmt train` (or average, export, --overwrite) on a run
that a live process trains is refused, naming that process; readers go on; a killed trainer
leaves no lock behind."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH, TINY_PAIRS, tiny_config, write_corpus
from transformer_mt.config.loading import save_config
from transformer_mt.core.errors import UsageError
from transformer_mt.runs.run_dir import RunLock, prepare_run_dir

ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}


def tmt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transformer_mt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=ENV)


@pytest.fixture
def training(tmp_path: Path):
    """(config, run directory, process): a `tmt train` that runs until stopped, past its first checkpoint."""
    corpus = write_corpus(tmp_path / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    config = tmp_path / "tiny.yaml"
    save_config(tiny_config(corpus, train={"max_steps": 1_000_000, "eval_every_steps": 1_000_000,
                                           "save_every_steps": 3, "log_every_steps": 1000}), config)
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "train", "--config", str(config),
                                "--run-dir", str(run_dir), "--no-progress"], cwd=tmp_path, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "best.pt").exists() and not list(run_dir.glob("checkpoints/step_*.pt")):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the first checkpoint never came"
        time.sleep(0.2)
    yield config, run_dir, process
    if process.poll() is None:
        process.kill()
    process.wait()


def test_a_second_trainer_on_a_training_run_is_refused_naming_the_first(training, tmp_path: Path, tmt_here):
    config, run_dir, process = training
    for extra in (["--resume"], ["--overwrite"], []):
        result = tmt_here("train", "--config", str(config), "--run-dir", str(run_dir), *extra, cwd=tmp_path)
        assert result.returncode == 2, (extra, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"tmt: error: {run_dir} is in use by tmt train "
                                                       f"(PID {process.pid} on "), (extra, result.stderr)
        assert "Traceback" not in result.stderr
    assert process.poll() is None  # the first trainer goes on, its files untouched (--overwrite deleted nothing)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.json").is_file()

    result = tmt_here("average", "--run", str(run_dir), "--last", "1", cwd=tmp_path)  # writes into the run
    assert result.returncode == 2 and f"is in use by tmt train (PID {process.pid}" in result.stderr, result.stderr

    result = tmt_here("export", "--format", "ctranslate2", "--run", str(run_dir), "--output", str(run_dir / "ct2"),
                      cwd=tmp_path)
    assert result.returncode == 2 and f"is in use by tmt train (PID {process.pid}" in result.stderr, result.stderr

    result = tmt_here("translate", "--run", str(run_dir), "--device", "cpu", "Good morning.", cwd=tmp_path)  # a reader
    assert result.returncode == 0, result.stderr
    result = tmt("runs", "--dir", str(run_dir), cwd=tmp_path)  # a subprocess: `tmt runs` as started
    assert result.returncode == 0 and "running" in result.stdout, result.stderr


def test_a_killed_trainer_leaves_no_lock_to_clean(training, tmp_path: Path, tmt_here):
    config, run_dir, process = training
    process.send_signal(signal.SIGKILL)
    process.wait()
    # Resumed with train.max_steps at its newest checkpoint: nothing left to train, the final test alone.
    newest = max(int(path.stem.split("_")[1]) for path in run_dir.glob("checkpoints/step_*.pt"))
    result = tmt_here("train", "--config", str(config), "--run-dir", str(run_dir), "--resume",
                      "--set", f"train.max_steps={newest}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_an_average_outside_the_run_does_not_need_its_lock(training, tmp_path: Path):
    _, run_dir, process = training
    # A subprocess: `tmt average` as it is started, once in the suite.
    result = tmt("average", "--run", str(run_dir), "--last", "1", "--output", str(tmp_path / "avg.pt"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert process.poll() is None


def test_the_lock_is_held_until_released_and_then_free(tmp_path: Path):
    run_dir = tmp_path / "run"
    lock = prepare_run_dir(run_dir, resume=False, overwrite=False)
    with pytest.raises(UsageError, match=rf"is in use by tmt train \(PID {os.getpid()} on "):
        RunLock.check_free(run_dir)
    lock.release()
    RunLock.check_free(run_dir)
    prepare_run_dir(run_dir, resume=False, overwrite=False).release()  # the lock file is tmt's own, not a user's


def test_a_filesystem_without_locks_gets_a_warning(tmp_path: Path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        lock = prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    assert not lock.held
    assert "does not support locks" in caplog.text and "No locks available" in caplog.text


# --- the names of the hypotheses files a test-set evaluation writes ---------------------------

def test_hypotheses_files_are_named_after_the_set_the_checkpoint_and_the_decoding(tmp_path: Path):
    from transformer_mt.core.run_layout import RunDir

    run = RunDir(tmp_path)
    assert run.hypotheses("test", "best", 4) == tmp_path / "evaluation" / "test.best.beam4.txt"
    assert run.hypotheses("test", "average_steps_00000002-00000006", 3).name == \
        "test.average_steps_00000002-00000006.beam3.txt"
    assert run.hypotheses("valid", "best", 4, alpha=0.6, quantized="int8").name == "valid.best.beam4.lp0.6.int8.txt"
    assert run.hypotheses("test", "best", 3, alpha=1.5).name == "test.best.beam3.lp1.5.txt"
    assert run.hypotheses("test", "best", 1, alpha=1.5).name == "test.best.beam1.txt"  # greedy: no length penalty
    assert run.hypotheses("test", "best", 2, alpha=0.0).name == "test.best.beam2.lp0.txt"
    assert run.hypotheses("test", "step_00000004", 1, quantized="int8").name == "test.step_00000004.beam1.int8.txt"
    # A file of sentences: its name and a digest of where it is, never a split's name.
    name = RunDir.source_file_name(tmp_path / "a" / "test.en")
    assert re.fullmatch(r"file-test\.en-[0-9a-f]{8}", name), name
    assert RunDir.source_file_name(tmp_path / "b" / "test.en") != name
    assert RunDir.source_file_name(tmp_path / "a" / "x" / ".." / "test.en") == name  # the same file, however named
    assert run.hypotheses(name, "step_00000004", 1).name == f"{name}.step_00000004.beam1.txt"
