"""`tmt runs`: a table of the runs under a folder."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from transformer_mt.cli.arguments import add_command, file_path
from transformer_mt.core.errors import UsageError

RUNS_EXAMPLES = """examples:
  tmt runs                          # the runs under ./runs, newest first
  tmt runs --dir /data/experiments
  cat runs/demo/summary.json        # one run's provenance, metrics, speed
"""


def add_parser(commands) -> None:
    """`tmt runs`: its options, help and examples."""
    runs = add_command(commands, "runs", "list training runs: status, steps, best BLEU, last update", RUNS_EXAMPLES)
    runs.add_argument("--dir", type=file_path,
                      help="folder holding run directories, also grouped one folder deeper (runs/<group>/<name>), "
                           "or one run directory (default: runs)")


def run_runs(args: argparse.Namespace) -> None:
    from transformer_mt.runs.summary import failure_notes, read_summaries, runs_table

    if args.dir is not None and not args.dir.is_dir():  # a typo must not read as "no runs yet"
        raise UsageError(f"--dir {args.dir}: {'not a folder' if args.dir.exists() else 'no such folder'}")
    folder = args.dir or Path("runs")
    rows = read_summaries(folder)
    print(runs_table(rows))  # with no runs, the header alone: scripts read an empty table, not an error
    for note in failure_notes(rows, min(shutil.get_terminal_size().columns, 100) - 1):
        print(note, file=sys.stderr)
    if not rows:
        print(f"tmt: no runs with a summary.json under {folder} (train one with `tmt train`, or pass --dir)",
              file=sys.stderr)
