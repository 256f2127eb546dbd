"""`tmt data`: the data report of a config, before training."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import TmtError


def run_data(args: argparse.Namespace) -> None:
    """Print the data report of a config without training, leaving no file behind
    (`preparation.preview_report`: with an existing run's tokenizers when they fit)."""
    from transformer_mt.config.loading import load_config

    setup_logging(logging.WARNING)
    cfg = load_config(args.config, args.overrides)  # before torch is imported: a config mistake is answered at once

    from transformer_mt.core.run_layout import run_dir_problem
    from transformer_mt.runs.init_from import check_parent
    from transformer_mt.runs.run_dir import data_settings_problem
    from transformer_mt.train.preparation import preview_report

    run_dir = args.run_dir or Path("runs") / cfg.name
    if args.run_dir is not None and (problem := run_dir_problem(args.run_dir)):  # a typo is no "not reused"
        raise TmtError(f"--run-dir {args.run_dir}: {problem}")
    if cfg.train.init_from:
        check_parent(cfg)  # a config `tmt train` would refuse gets no report
    report, notes, reuse = preview_report(cfg, run_dir, progress=not args.quiet)
    if args.run_dir is not None and not reuse:
        notes.append(f"--run-dir {args.run_dir} not used: {data_settings_problem(cfg, args.run_dir)}")
    for note in notes:
        print(f"tmt: {note}", file=sys.stderr)
    print(report.render())
    if reuse:
        source = f"the tokenizers of {run_dir}"
    elif cfg.train.init_from:
        source = f"the tokenizers of {cfg.train.init_from} (train.init_from)"
    else:
        source = "tokenizers trained for this report (not saved)"
    print(f"tmt: data report of {args.config} with {source}", file=sys.stderr)
