"""A signal while the data is prepared stops at once: Ctrl-C (SIGINT to the whole process group,
as a terminal sends it) during tokenization with two processes ends within seconds, exit 130,
one line saying how to go on, no traceback, no worker left, no cache entry a later run would trust."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH, REPO, tiny_config
from transformer_mt.config.loading import save_config

PAIRS = 110_000  # two tokenizing processes need 2 × token_cache.MIN_ROWS_PER_PROCESS pairs


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_synthetic_corpus.py"), "--pairs", str(PAIRS),
                    "--out", str(root / "corpus"), "--vocab", "2000"], check=True, capture_output=True)
    config = root / "big.yaml"
    save_config(tiny_config(root / "corpus", data={"num_proc": 2, "max_words": 1000}, model={"max_len": 128},
                            train={"batch_tokens": 256}, tokenizer={"vocab_size": 300, "max_train_pairs": 2000}),
                config)
    return config


def catch_sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it. A suite started in
    the background by a non-interactive shell (`pytest &`) ignores SIGINT, every process it starts
    inherits that, and Python then keeps ignoring it: tmt would never see this test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_until_tokenizing(config: Path, run_dir: Path, err: Path) -> subprocess.Popen:
    """`tmt train` in a process group of its own, returned once it has begun tokenizing the train split."""
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "train", "--config", str(config),
                                "--run-dir", str(run_dir), "--no-progress"], cwd=run_dir.parent,
                               stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True,
                               env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
                               preexec_fn=catch_sigint_as_in_a_terminal)
    deadline = time.monotonic() + 120
    while "trained BPE tokenizers" not in err.read_text():
        assert process.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)
    time.sleep(1.5)  # into the tokenizing processes' work (it takes several seconds)
    assert process.poll() is None, err.read_text()
    return process


def group_is_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_ctrl_c_while_two_processes_tokenize_stops_within_seconds(big_config: Path, tmp_path: Path):
    run_dir, err = tmp_path / "run", tmp_path / "stderr"
    process = start_until_tokenizing(big_config, run_dir, err)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 5 s after SIGINT; its stderr:\n{err.read_text()}")
    finally:
        if not group_is_gone(process.pid, 0):
            os.killpg(process.pid, signal.SIGKILL)
    text = err.read_text()
    assert code == 130, text
    assert "Traceback" not in text and "ForkPoolWorker" not in text, text
    # A stop the user asked for, not an error: the same words as a stop while training.
    assert text.strip().splitlines()[-1] == (f"tmt: interrupted; continue with: tmt train --config "
                                             f"{big_config} --run-dir {run_dir}")
    assert "error" not in text, text
    assert group_is_gone(process.pid, 2)  # no tokenizing process outlives tmt
    assert not run_dir.exists()  # a first start stopped before training leaves no run: no entry, no temp folder


def test_tokenizing_processes_die_with_a_killed_parent(big_config: Path, tmp_path: Path):
    run_dir, err = tmp_path / "run", tmp_path / "stderr"
    process = start_until_tokenizing(big_config, run_dir, err)
    process.kill()  # SIGKILL to tmt alone, not its group
    process.wait()
    try:
        assert group_is_gone(process.pid, 3)
    finally:
        if not group_is_gone(process.pid, 0):
            os.killpg(process.pid, signal.SIGKILL)
