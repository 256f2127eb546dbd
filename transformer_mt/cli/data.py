"""`tmt data`: the data report of a config, before training."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformer_mt.cli.arguments import add_command, file_path
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import TmtError

DATA_EXAMPLES = """examples:
  # the report tmt train logs before its first step
  tmt data --config configs/demo.yaml
  tmt data --config configs/demo.yaml --set tokenizer.vocab_size=2000 \\
      --set model.max_len=32
  # steps per epoch at another token budget
  tmt data --config configs/demo.yaml --set train.batch_tokens=4096
  # what data.filters remove, filter by filter, with examples
  tmt data --config configs/noisy-demo.yaml
  tmt data --config configs/noisy-demo.yaml --removed removed-pairs/
  tmt data --config configs/demo.yaml \\
      --set 'data.filters=[dedup, {name: length, max_length: 50}]'

Nothing is written (but --removed DIR): tokenizers are trained in a temporary folder, or reused from
the run directory (--run-dir, default runs/<name>) when its data and tokenizer settings are the same.
"""


def add_parser(commands) -> None:
    """`tmt data`: its options, help and examples."""
    data = add_command(commands, "data", "report on the data before training: pairs, filters, lengths, "
                                             "unknown tokens, steps per epoch", DATA_EXAMPLES)
    data.add_argument("--config", required=True, type=file_path, help="YAML config file")
    data.add_argument("--run-dir", type=file_path, help="a run whose tokenizers and data split to reuse, read only "
                                                   "(default: runs/<name from config>, if it exists)")
    data.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set model.max_len=64 (repeatable)")
    data.add_argument("--removed", type=file_path, metavar="DIR",
                      help="write the pairs each of data.filters removes into the new folder DIR, a file per filter "
                           "and split (the first 10,000 lines of each)")
    data.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bars")


def run_data(args: argparse.Namespace) -> None:
    """Print the data report of a config without training, leaving no file behind
    (`preparation.preview_report`: with an existing run's tokenizers when they fit)."""
    from transformer_mt.config.loading import load_config

    setup_logging(logging.WARNING)
    def inherit(written):  # train.init_from: the settings the config leaves to the parent, read when it names one
        from transformer_mt.runs.init_from import inherited_settings

        return inherited_settings(written)

    # Before torch is imported (but for a parent's settings): a config mistake is answered at once
    cfg = load_config(args.config, args.overrides, inherit)

    from transformer_mt.core.files import check_new_dir
    from transformer_mt.core.run_layout import run_dir_problem
    from transformer_mt.runs.init_from import check_parent
    from transformer_mt.runs.run_dir import data_settings_problem
    from transformer_mt.train.preparation import preview_report
    from transformer_mt.train.trainer import check_freeze

    if args.removed is not None:
        check_new_dir(args.removed, "--removed")
    run_dir = args.run_dir or Path("runs") / cfg.name
    if args.run_dir is not None and (problem := run_dir_problem(args.run_dir)):  # a typo is no "not reused"
        raise TmtError(f"--run-dir {args.run_dir}: {problem}")
    if cfg.train.init_from:
        check_parent(cfg)  # a config `tmt train` would refuse gets no report
    check_freeze(cfg)  # nor one that leaves nothing to train
    report, notes, reuse = preview_report(cfg, run_dir, progress=not args.quiet, removed_to=args.removed)
    if args.removed is not None and not report.filtered:
        notes.append(f"--removed {args.removed}: nothing written, the config has no data.filters")
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
