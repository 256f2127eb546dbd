"""What a person at a terminal sees: `tmt train` under a pseudo-terminal, its progress bars and
log lines drawn by a small terminal emulator."""

from __future__ import annotations

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

from tests.conftest import DEMO_CONFIG, PYTHONPATH

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


def test_training_in_a_terminal_never_draws_a_bar_and_a_log_line_on_one_line(tmp_path: Path):
    code, output = run_in_terminal(
        ["train", "--config", str(DEMO_CONFIG), "--run-dir", str(tmp_path / "run"),
         "--set", "train.max_steps=60", "--set", "train.log_every_steps=10", "--set", "train.eval_every_steps=30",
         "--set", "train.save_every_steps=30", "--set", "model.d_model=32", "--set", "model.d_ff=64"],
        cwd=tmp_path)
    lines = screen_lines(output)
    assert code == 0, "\n".join(lines)
    logged = [line for line in lines if TIMESTAMP.search(line)]
    assert len(logged) > 10, "\n".join(lines)  # the run logged, and through the terminal
    shared = [line for line in logged if BAR.search(line) or not TIMESTAMP.match(line)]
    assert not shared, "\n".join(shared)
    # tmt's bars are gone once done: nothing of one is left between or after the log lines.
    # (The finished bars of `datasets.map`, "tokenize train: 100%|...", stay on lines of their own.)
    leftovers = [line for line in lines if BAR.search(line) and not line.startswith("tokenize ")]
    assert not leftovers, "\n".join(leftovers)
    assert lines[-1].startswith("tmt: finished at step 60") or lines[-2].startswith("tmt: finished at step 60")
