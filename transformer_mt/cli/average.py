"""`tmt average`: the average of a run's last step checkpoints."""

from __future__ import annotations

import argparse
import logging
import sys

from transformer_mt.cli.arguments import add_command, file_path, positive_int
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import CheckpointError, UsageError
from transformer_mt.core.files import make_parent_dir
from transformer_mt.core.run_layout import RunDir, find_checkpoint

AVERAGE_EXAMPLES = """examples:
  tmt average --run runs/m30k            # the last 5 step checkpoints
  tmt average --run runs/demo --last 2   # the demo keeps 2 (train.keep_last)
  tmt evaluate --beam 5 \\
      --checkpoint runs/demo/checkpoints/average_steps_00000900-00001200.pt
"""


def add_parser(commands) -> None:
    """`tmt average`: its options, help and examples."""
    average = add_command(commands, "average", "average the weights of a run's last step checkpoints", AVERAGE_EXAMPLES)
    average.add_argument("--run", type=file_path, required=True, help="run directory")
    average.add_argument("--last", type=positive_int, default=5, metavar="N",
                         help="how many of the newest step checkpoints to average (default 5)")
    average.add_argument("--output", type=file_path,
                         help="default: <run>/checkpoints/average_steps_<first>-<last>.pt (keep it in "
                              "<run>/checkpoints/ so that --checkpoint finds the run's tokenizers)")


def run_average(args: argparse.Namespace) -> None:
    from transformer_mt.runs.checkpoint import CheckpointDir, average_checkpoints, is_average_checkpoint, save_atomic
    from transformer_mt.runs.run_dir import lock_if_inside

    setup_logging(logging.INFO)
    checkpoints = CheckpointDir(RunDir(args.run).checkpoints, keep_last=1)
    steps = checkpoints.steps()
    if not steps:  # as translate, evaluate and export say it: a missing run is no bad argument (exit 1)
        find_checkpoint(args.run)  # no such run directory, a file, or no checkpoint at all
        raise CheckpointError(f"{args.run}: no step checkpoint in {checkpoints.directory} to average")
    if len(steps) < args.last:
        raise UsageError(f"{args.run}: {len(steps)} step checkpoint(s) on disk, fewer than --last {args.last} "
                         "(train.keep_last sets how many a run keeps)")
    steps = steps[-args.last:]
    named = f"average_steps_{steps[0]:08d}-{steps[-1]:08d}.pt"
    output = args.output or checkpoints.directory / named
    another = output.parent.parent  # a run whose checkpoints/ the output would land in
    if (output.parent.resolve() != checkpoints.directory.resolve() and RunDir(another).marker.is_file()
            and RunDir(another).keeps(output)):  # its test_scores.json may name an average there
        raise UsageError(f"--output {output}: that is {another}'s checkpoints folder, not {args.run}'s; "
                         "choose a file outside it")
    # Re-running an average may replace its earlier output, and only that: an average tmt wrote of
    # the same steps (so named), never a user's file so named, nor an average of other steps, such
    # as the one behind the run's evaluation/test_scores.json.
    if output.is_dir() or (output.exists() and not (output.name == named and is_average_checkpoint(output))):
        raise UsageError(f"--output {output} already exists; tmt average replaces only its own average of the "
                         f"same steps ({named}): choose a new file name")
    make_parent_dir(output, "--output" if args.output else None)
    with lock_if_inside(args.run, output, "tmt average"):  # never beside the run's trainer
        save_atomic(average_checkpoints([checkpoints.step_path(step) for step in steps]), output)
    print(f"averaged steps {', '.join(map(str, steps))} into {output}", file=sys.stderr)
