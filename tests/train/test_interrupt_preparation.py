"""A signal while the data is prepared stops at once: Ctrl-C (SIGINT to the whole process group,
as a terminal sends it) during tokenization with two processes ends within seconds, exit 130,
one line saying how to go on, no traceback, no worker left, no cache entry a later run would trust."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH, REPO, tiny_config
from transformer_mt.config.loading import save_config

PAIRS = 110_000  # two tokenizing processes need 2 × token_cache.MIN_ROWS_PER_PROCESS pairs


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_synthetic_corpus.py"), "--pairs", str(PAIRS),
                    "--out", str(root / "corpus"), "--vocab", "2000"], check=True, capture_output=True)
    config = root / "big.yaml"
    # A BPE-dropout segmentation is encoded line by line (no word is looked up: each is drawn afresh), so
    # tokenizing takes seconds even on an idle machine, where the plain ids alone would take one.
    save_config(tiny_config(root / "corpus", data={"num_proc": 2, "max_words": 1000}, model={"max_len": 128},
                            train={"batch_tokens": 256}, tokenizer={"vocab_size": 300, "max_train_pairs": 2000,
                                                                    "bpe_dropout": 0.1, "bpe_dropout_variants": 1}),
                config)
    return config


def catch_sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it. A suite started in
    the background by a non-interactive shell (`pytest &`) ignores SIGINT, every process it starts
    inherits that, and Python then keeps ignoring it: tmt would never see this test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_until(config: Path, run_dir: Path, err: Path, line: str, then_s: float) -> subprocess.Popen:
    """`tmt train` in a process group of its own, its stderr in `err`, returned `then_s` seconds after it
    logged `line` (still running)."""
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "train", "--config", str(config),
                                "--run-dir", str(run_dir), "--no-progress"], cwd=run_dir.parent,
                               stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True,
                               env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
                               preexec_fn=catch_sigint_as_in_a_terminal)
    deadline = time.monotonic() + 120
    while line not in err.read_text():
        assert process.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)
    time.sleep(then_s)
    assert process.poll() is None, err.read_text()
    return process


def start_until_tokenizing(config: Path, run_dir: Path, err: Path) -> subprocess.Popen:
    """`tmt train`, returned once it has begun tokenizing the train split (several seconds of work)."""
    return start_until(config, run_dir, err, "trained BPE tokenizers", 1.5)


def signal_group_and_wait(process: subprocess.Popen, sig: signal.Signals, within_s: float, err: Path) -> int:
    """Send `sig` to the process's group, as a terminal's Ctrl-C does -> its exit code, within `within_s`
    (else the test fails); nothing of the group is left either way."""
    os.killpg(process.pid, sig)
    try:
        return process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {within_s:g} s after {sig.name}; its stderr:\n{err.read_text()}")
    finally:
        if not group_is_gone(process.pid, 0):
            os.killpg(process.pid, signal.SIGKILL)


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
    code = signal_group_and_wait(process, signal.SIGINT, 5, err)
    text = err.read_text()
    assert code == 130, text
    assert "Traceback" not in text and "ForkPoolWorker" not in text, text
    # A stop the user asked for, not an error: the same words as a stop while training.
    assert text.strip().splitlines()[-1] == (f"tmt: interrupted; continue with: tmt train --config "
                                             f"{big_config} --run-dir {run_dir}")
    assert "error" not in text, text
    assert group_is_gone(process.pid, 2)  # no tokenizing process outlives tmt
    assert not run_dir.exists()  # a first start stopped before training leaves no run: no entry, no temp folder


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_bpe_trains_stops_within_seconds(sig, tmp_path: Path):
    """The BPE reads its lines on the tokenizers library's own threads, where no signal handler runs:
    without a thread of its own the signal waited for the training's end (many seconds here)."""
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_synthetic_corpus.py"), "--pairs", "300000",
                    "--out", str(tmp_path / "corpus"), "--vocab", "20000"], check=True, capture_output=True)
    config, run_dir, err = tmp_path / "bpe.yaml", tmp_path / "run", tmp_path / "stderr"
    save_config(tiny_config(tmp_path / "corpus", data={"max_words": 1000}, tokenizer={"vocab_size": 300}), config)
    process = start_until(config, run_dir, err, "corpus: ", 1)  # read: the BPE starts on all 600,000 lines
    assert "trained BPE" not in err.read_text(), err.read_text()
    code = signal_group_and_wait(process, sig, 3, err)
    text = err.read_text()
    assert code == 128 + sig and "Traceback" not in text and "trained BPE" not in text, text
    said = "interrupted" if sig == signal.SIGINT else "interrupted by SIGTERM"
    assert text.strip().splitlines()[-1] == (f"tmt: {said}; continue with: tmt train --config {config} "
                                             f"--run-dir {run_dir}")


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


def test_a_signal_while_tokenizing_on_a_busy_machine_ends_every_process_within_2_s(big_config: Path, tmp_path: Path):
    """As a user meets it: output to a pipe, CPU-bound competitors, a signal at moments from
    the tokenizing processes' start into their work. The pipe's EOF: no process holding it is left.
    Rounds catch a race: Ctrl-C to the group, SIGTERM to tmt alone (`kill`), SIGTERM to the group."""
    rounds = [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)] * 2
    delays = [0.0, 0.0, 0.02, 0.05, 0.4, 1.0]  # after the line; at first the processes are being started
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    latencies = []
    try:
        for number, ((sig, group), delay) in enumerate(zip(rounds, delays)):
            run_dir = tmp_path / f"run{number}"
            process, ended, lines = start_with_output_to_a_pipe(big_config, run_dir)
            try:
                time.sleep(delay)
                assert process.poll() is None, "".join(lines)
                sent = time.monotonic()
                (os.killpg if group else os.kill)(process.pid, sig)
                gone = ended.wait(timeout=2)  # EOF: no process holds the pipe any more
                latency = time.monotonic() - sent
                code = process.wait(timeout=2 if gone else 0.1)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                left = not group_is_gone(process.pid, 0)
                if left:
                    os.killpg(process.pid, signal.SIGKILL)
            text = "".join(lines)
            where = f"round {number} ({sig.name} to the {'group' if group else 'process'}, {delay:.1f} s in)"
            assert gone and not left, f"{where}: processes left 2 s after the signal; output:\n{text}"
            latencies.append(latency)
            assert code == 128 + sig, f"{where}:\n{text}"
            assert "Traceback" not in text and "ForkPoolWorker" not in text, f"{where}:\n{text}"
            said = "interrupted" if sig == signal.SIGINT else "interrupted by SIGTERM"
            assert text.strip().splitlines()[-1] == (f"tmt: {said}; continue with: tmt train --config {big_config} "
                                                     f"--run-dir {run_dir}"), f"{where}:\n{text}"
            assert not run_dir.exists(), where  # a first start stopped before training leaves no run, no half entry
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"from the signal to the pipe's EOF: {', '.join(f'{s:.2f}' for s in latencies)} s")


def start_with_output_to_a_pipe(config: Path, run_dir: Path) -> tuple[subprocess.Popen, threading.Event, list[str]]:
    """`tmt train` in a process group of its own, stdout and stderr one pipe read by a thread (its lines
    collected; the event set at EOF), returned once its tokenizers are trained: tokenizing starts."""
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "train", "--config", str(config),
                                "--run-dir", str(run_dir), "--no-progress"], cwd=run_dir.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
                               preexec_fn=catch_sigint_as_in_a_terminal)
    lines, tokenizing, ended = [], threading.Event(), threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "trained BPE tokenizers" in line:
                tokenizing.set()
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    if not tokenizing.wait(timeout=120):
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("".join(lines))
    return process, ended, lines


def test_a_tokenizing_process_killed_by_the_system_is_one_line_not_a_hang(big_config: Path, tmp_path: Path):
    """The kernel's OOM killer, say: a SIGKILL to one tokenizing process alone."""
    run_dir = tmp_path / "run"
    process, ended, lines = start_with_output_to_a_pipe(big_config, run_dir)
    try:
        children, deadline = [], time.monotonic() + 30
        while len(children) < 2:  # the two tokenizing processes, once started
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        os.kill(int(children[-1]), signal.SIGKILL)
        code = process.wait(timeout=30)
        ended.wait(timeout=5)
    finally:
        if not group_is_gone(process.pid, 0):
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(lines)
    assert code == 1, text
    assert text.splitlines()[-1] == ("tmt: error: tokenizing the train split: process 2 of 2 ended without its shard "
                                     "(exit code -9; out of memory? data.num_proc sets how many run)"), text
    assert "Traceback" not in text and group_is_gone(process.pid, 2)
    assert not run_dir.exists()  # a new run that never trained leaves nothing
