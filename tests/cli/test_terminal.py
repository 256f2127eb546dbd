"""What a person at a terminal sees: `tmt train` under a pseudo-terminal (its progress bars and
log lines drawn by a small terminal emulator), and the messages and help around tmt's output."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.helpers import DEMO_CONFIG, PYTHONPATH, run_cli
from transformer_mt.cli.parser import build_parser
from transformer_mt.config.loading import load_config

TIMESTAMP = re.compile(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")
BAR = re.compile(r"\d+/\d+ \[|[?\d.]+(it|step|batch|line)/s\]|\|[ #▏▎▍▌▋▊▉█]*\|")


def run_in_terminal(args: list[str], cwd: Path, columns: int = 80, timeout_s: float = 240) -> tuple[int, bytes]:
    """Run `python -m transformer_mt ARGS` with stdin, stdout and stderr on a pseudo-terminal
    `columns` wide; returns its exit code and every byte it wrote to the terminal."""
    main_fd, child_fd = pty.openpty()
    # A terminal has a size: 40 rows of `columns` (tqdm asks the terminal, not $COLUMNS).
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": PYTHONPATH,
           "COLUMNS": str(columns), "LINES": "40", "TERM": "xterm"}
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", *args], cwd=cwd, env=env,
                               stdin=child_fd, stdout=child_fd, stderr=child_fd, close_fds=True)
    os.close(child_fd)
    output = bytearray()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main_fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not chunk:
                break
            output += chunk
        elif process.poll() is not None:
            break
    os.close(main_fd)
    return process.wait(timeout=30), bytes(output)


def screen_lines(output: bytes) -> list[str]:
    """The lines a terminal shows after `output`: carriage returns go back to the line's start and
    overwrite it, `ESC [ n A` moves up, other escape sequences are dropped. Unbounded scrollback."""
    text = output.decode("utf-8", errors="replace").replace("\r\n", "\n")
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\x1b":
            match = re.match(r"\x1b\[(\d*)([A-Za-z])", text[i:])
            if match:
                if match.group(2) == "A":
                    row = max(0, row - int(match.group(1) or 1))
                i += match.end()
                continue
        elif char == "\r":
            col = 0
        elif char == "\n":
            row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
        else:
            line = rows[row]
            line.extend(" " * (col - len(line) + 1))
            line[col] = char
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in rows]


def test_screen_lines_overwrite_a_line_after_a_carriage_return():
    # A bar drawn, cleared with spaces, then a log line written over it, then the bar again below.
    lines = screen_lines(b"train: 10%|#  | 1/10 [00:01<00:09]\r" + b" " * 40 + b"\r12:00:00 INFO step 1\n"
                         b"train: 20%|##| 2/10\x1b[A\rX")
    assert lines == ["X2:00:00 INFO step 1", "train: 20%|##| 2/10"]


@pytest.fixture(scope="module")
def terminal_training(tmp_path_factory) -> tuple[int, bytes]:
    """`tmt train` of a small demo model in an 80-column terminal: its exit code and what it wrote there."""
    tmp_path = tmp_path_factory.mktemp("terminal")
    return run_in_terminal(
        ["train", "--config", str(DEMO_CONFIG), "--run-dir", str(tmp_path / "run"),
         "--set", "train.max_steps=60", "--set", "train.log_every_steps=10", "--set", "train.eval_every_steps=30",
         "--set", "train.save_every_steps=30", "--set", "model.d_model=32", "--set", "model.d_ff=64"],
        cwd=tmp_path, columns=80)


def test_training_in_a_terminal_never_draws_a_bar_and_a_log_line_on_one_line(terminal_training):
    code, output = terminal_training
    lines = screen_lines(output)
    assert code == 0, "\n".join(lines)
    logged = [line for line in lines if TIMESTAMP.search(line)]
    assert len(logged) > 10, "\n".join(lines)  # the run logged, and through the terminal
    shared = [line for line in logged if BAR.search(line) or not TIMESTAMP.match(line)]
    assert not shared, "\n".join(shared)
    # The bars are gone once done, tmt's and the tokenizing `datasets.map`'s ("tokenize train: 100%|...",
    # which datasets leaves on the screen): nothing of one is left between or after the log lines.
    leftovers = [line for line in lines if BAR.search(line)]
    assert not leftovers, "\n".join(leftovers)
    assert lines[-1].startswith("tmt: finished at step 60") or lines[-2].startswith("tmt: finished at step 60")


def bar_draws(output: bytes, desc: str) -> list[str]:
    """Every state of the bar called `desc` as the terminal showed it, in order (escape sequences dropped)."""
    text = re.sub(r"\x1b\[\d*[A-Za-z]", "", output.decode("utf-8", errors="replace"))
    return [part for part in re.split(r"[\r\n]", text) if part.startswith(f"{desc}:")]


def test_the_training_bar_at_80_columns_shows_loss_tokens_per_s_and_the_log_lines_time_left(terminal_training):
    code, output = terminal_training
    log = "\n".join(screen_lines(output))
    assert code == 0, log
    time_left = dict(re.findall(r"INFO step (\d+)/60 \(\d+%, (.+?) left\)", log))
    assert list(time_left) == ["10", "20", "30", "40", "50", "60"], log
    drawn = {}  # the bar as last drawn at each step: after that step's log line
    for line in bar_draws(output, "train"):
        assert len(line) <= 80, line
        drawn[re.search(r" (\d+)/60\b", line).group(1)] = line
    for step, left in time_left.items():
        bar = drawn[step]
        assert re.search(r"loss \d+\.\d{3}", bar) and re.search(r"\d[\d,]* tgt tok/s", bar), bar
        assert f" {left} left" in bar, (bar, left)  # the very estimate of the log line
        assert re.search(r"\|[ ▏▎▍▌▋▊▉█]{10,}\|", bar), bar  # and room for the bar itself


# --- messages and help: what `tmt` says around its output --------------------------------------

def test_every_step_line_of_the_log_file_says_how_far_and_how_long_is_left(workdir: Path):
    log = (workdir / "runs" / "tiny" / "train.log").read_text("utf-8")
    steps = re.findall(r"INFO transformer_mt.train.trainer: step (\d+)/4 \((\d+)%, ([\d.]+s|\d+m \d\ds) left\): loss", log)
    # log_every_steps 1: steps 1 to 4, each with its share of train.max_steps=4 (25% a step)
    assert [(int(step), int(percent)) for step, percent, _ in steps] == [(1, 25), (2, 50), (3, 75), (4, 100)], log
    assert steps[-1][2] == "0s"


def test_translate_without_run_says_on_stderr_which_run_and_languages_it_used(workdir: Path, tmt_here):
    result = tmt_here("translate", "Good morning.", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1  # stdout holds the translation alone
    assert "using runs/tiny (en->it, best.pt)" in result.stderr and "--run DIR" in result.stderr
    # Named with --run, the run needs no introduction.
    result = tmt_here("translate", "--run", "runs/tiny", "Good morning.", cwd=workdir)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_evaluate_names_its_output_relative_to_the_working_folder_however_the_run_was_given(workdir: Path, tmt_here):
    for model in (["--run", "runs/tiny"], ["--checkpoint", "runs/tiny/checkpoints/best.pt"]):
        result = tmt_here("evaluate", *model, "--quiet", cwd=workdir)
        assert result.returncode == 0, result.stderr
        assert result.stderr.rstrip().endswith("hypotheses in runs/tiny/evaluation/test.best.beam1.txt"), result.stderr


def test_a_failed_start_writes_its_error_into_train_log(workdir: Path, tmt_here):
    # A sacreBLEU tokenizer this machine lacks is found once the run directory and its log exist:
    # a resumed run keeps the error in its log; a first start leaves no run directory behind.
    result = tmt_here("train", "--config", "tiny.yaml", "--run-dir", "runs/tiny", "--resume",
                      "--set", "train.bleu_tokenize=ja-mecab", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    stderr_error = next(line for line in result.stderr.splitlines() if line.startswith("tmt: error:"))
    assert f"ERROR transformer_mt: {stderr_error}" in (workdir / "runs" / "tiny" / "train.log").read_text("utf-8")
    result = tmt_here("train", "--config", "tiny.yaml", "--run-dir", "runs/failed",
                      "--set", "train.bleu_tokenize=ja-mecab", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("tmt: error:") == 1 and not (workdir / "runs" / "failed").exists()


def test_runs_without_any_run_prints_an_empty_table_and_succeeds(tmp_path: Path, monkeypatch, capsys):
    code, out, err = run_cli(["runs"], monkeypatch, capsys, tmp_path)
    assert code == 0
    assert out.split() == ["run", "status", "steps", "valid", "BLEU", "test", "BLEU", "updated"]
    assert "no runs" in err


def test_a_mistyped_command_or_choice_gets_a_suggestion(tmp_path: Path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(["trian", "--config", "x.yaml"], monkeypatch, capsys, tmp_path)
    assert exit_.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err.splitlines()[-1].split("(did you mean 'train'?)")[0]
    with pytest.raises(SystemExit):
        run_cli(["evaluate", "--device", "cdua"], monkeypatch, capsys, tmp_path)
    assert capsys.readouterr().err.rstrip().endswith("(did you mean 'cuda'?)")


@pytest.mark.parametrize("args, line", [
    (["export", "--format", "onnx", "--run", "r", "--output", "o"],
     "tmt: error: tmt export: argument --format: invalid choice: 'onnx' (choose from 'ctranslate2', 'hf')"),
    (["export", "--run", "r"], "tmt: error: tmt export: the following arguments are required: --output"),
    (["translate", "--beam", "two"], "tmt: error: tmt translate: argument --beam: expected a whole number, got 'two'"),
    (["runs", "--all"], "tmt: error: unrecognized arguments: --all"),
])
def test_a_command_line_mistake_is_one_line(args, line, tmp_path: Path, monkeypatch, capsys):
    """The line that matters alone, not after argparse's usage lines."""
    with pytest.raises(SystemExit) as exit_:
        run_cli(args, monkeypatch, capsys, tmp_path)
    assert (exit_.value.code, capsys.readouterr().err) == (2, line + "\n")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_help_opens_with_a_description_and_every_option_has_help():
    for name, command in subcommands().items():
        text = command.format_help()
        after_usage = text.split("\n\n")[1]
        assert after_usage == after_usage.strip() and after_usage[0].isupper() and after_usage.endswith("."), name
        for action in command._actions:
            assert action.help, f"tmt {name} {action.option_strings or action.dest}: no help"


def test_progress_is_turned_off_by_the_same_options_everywhere():
    for name, command in subcommands().items():
        if any("--quiet" in action.option_strings for action in command._actions):
            options = next(a.option_strings for a in command._actions if "--quiet" in a.option_strings)
            assert options == ["--quiet", "--no-progress"], name


def test_help_examples_name_only_checkpoints_the_demo_writes():
    # The demo saves every train.save_every_steps and keeps the last train.keep_last step checkpoints.
    train = load_config(DEMO_CONFIG).train
    saved = list(range(train.save_every_steps, train.max_steps + 1, train.save_every_steps))[-train.keep_last:]
    written = {f"step_{step:08d}.pt" for step in saved} | {"best.pt", f"average_steps_{saved[0]:08d}-{saved[-1]:08d}.pt"}
    examples = [build_parser().epilog] + [command.epilog for command in subcommands().values()]
    named = {name for text in examples for name in re.findall(r"checkpoints/(\S+\.pt)", text)}
    assert named and named <= written, named - written
