"""The transcripts of the README and the guides marked `<!-- runnable: the demo -->` are run as written,
in a folder where the demo was trained as the README says; each output line must read as the page
shows it, numbers aside (a line `...`: any lines; `...` or `[...]` within a line: any text)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PYTHONPATH, REPO

MARK = "<!-- runnable: the demo -->"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# Opt-in: it trains the demo as the README says, two minutes of a 2-core machine (CI runs it).
transcripts_opt_in = pytest.mark.skipif(not os.environ.get("TMT_TEST_TRANSCRIPTS"),
                                        reason="trains the demo (minutes); set TMT_TEST_TRANSCRIPTS=1")


def transcripts() -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """(page:line, [(command, the output lines shown)]) of each marked console block."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            assert lines[number + 1] == "```console", f"{page}:{number + 1}: a console block must follow {MARK}"
            end = lines.index("```", number + 2)
            steps: list[tuple[str, list[str]]] = []
            for text in lines[number + 2:end]:
                if text.startswith("$ "):
                    steps.append((text[2:], []))
                else:
                    steps[-1][1].append(text)
            for _, shown in steps:  # the blank line before the next command is no output
                while shown and not shown[-1]:
                    shown.pop()
            found.append((f"{page.relative_to(REPO)}:{number + 1}", steps))
    return found


def shape(lines: list[str]) -> re.Pattern:
    """What output matches `lines` as a page shows them: other numbers, other runs of spaces."""
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:.*\n)*?")
            continue
        pattern = ""
        for piece in re.split(r"(\[\.\.\.\]|\.\.\.|\s+|\d+)", line):
            if piece in ("...", "[...]"):
                pattern += ".*"
            elif piece.isdigit():
                pattern += r"\d+"
            elif piece and piece.isspace():
                pattern += r"\s+"
            else:
                pattern += re.escape(piece)
        parts.append(pattern + r"\n")
    return re.compile("".join(parts))


def test_the_shape_of_a_line_is_its_text_with_any_numbers():
    assert shape(["demo  finished  1200/1200  58.09       48.41"]).fullmatch("demo  finished  300/300  7.5  8.25\n")
    assert not shape(["demo  finished  1200/1200"]).fullmatch("demo  failed  1200/1200\n")
    assert shape(["a", "...", "b [...] c ..."]).fullmatch("a\nx\ny\nb [1, 2] c 3 4\n")
    assert not shape(["tmt: using runs/demo"]).fullmatch("Dov'è la stazione?\n")


@transcripts_opt_in
@pytest.mark.longest
def test_every_runnable_transcript_reads_as_tmt_prints_it(tmp_path: Path):
    """One test, in the pages' order (the README's trains the demo the others use): one training."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / ".bin").mkdir()
    (tmp_path / ".bin" / "tmt").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m transformer_mt "$@"\n')
    (tmp_path / ".bin" / "tmt").chmod(0o755)
    env = {"PATH": f"{tmp_path / '.bin'}:/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    found = transcripts()
    assert [where.split(":")[0] for where, _ in found][:1] == ["README.md"]  # the README's trains the demo
    for where, steps in found:
        for command, shown in steps:
            result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, timeout=900)
            assert result.returncode == 0, f"{where}: $ {command}\n{result.stdout[-3000:]}"
            assert shape(shown).fullmatch(result.stdout), (
                f"{where}: $ {command}\nthe page shows:\n" + "\n".join(shown) + f"\ntmt printed:\n{result.stdout[-3000:]}")
