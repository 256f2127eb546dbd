"""`tmt train`: load the config, prepare the run directory (rank 0 under torchrun), train, and say
how to continue after a stop."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from transformer_mt.cli.arguments import add_command, file_path
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import (ConfigError, DataError, TmtError, TrainingStopped, WriteError, error_line,
                                        interrupted)
from transformer_mt.core.run_layout import RunDir

logger = logging.getLogger("transformer_mt")

TRAIN_EXAMPLES = """examples:
  tmt train --config configs/demo.yaml
  tmt train --config configs/demo.yaml --set train.max_steps=2000 \\
      --set model.dropout=0.2
  tmt train --config configs/demo.yaml --resume   # from the newest checkpoint
  tensorboard --logdir runs                       # watch the curves
"""


def add_parser(commands) -> None:
    """`tmt train`: its options, help and examples."""
    train = add_command(commands, "train", "train a model from a YAML config", TRAIN_EXAMPLES)
    train.add_argument("--config", required=True, type=file_path, help="YAML config file")
    train.add_argument("--run-dir", type=file_path, help="where the run is written (default: runs/<name from config>)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.lr=3e-4 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    train.add_argument("--overwrite", action="store_true", help="delete an existing run in --run-dir and start over")
    train.add_argument("--quiet", "--no-progress", dest="no_progress", action="store_true",
                       help="no progress bars (the log lines stay)")


def run_train(args: argparse.Namespace) -> None:
    from transformer_mt.config.loading import load_config

    def inherit(written):  # train.init_from: the settings the config leaves to the parent, read when it names one
        from transformer_mt.runs.init_from import inherited_settings

        return inherited_settings(written, (args.run_dir or Path("runs") / written.name) if args.resume else None)

    # Before torch is imported (but for a parent's settings): a config mistake is answered at once
    cfg = load_config(args.config, args.overrides, inherit)

    from transformer_mt.core.distributed import Distributed
    from transformer_mt.core.runtime import machine_memory_bytes, pick_device, pick_precision
    from transformer_mt.runs.init_from import check_parent
    from transformer_mt.train.batches import check_model_fits
    from transformer_mt.train.trainer import check_freeze, train

    run_dir = args.run_dir or Path("runs") / cfg.name
    device = pick_device(cfg.train.device)
    pick_precision(cfg.train.precision, device)  # refuse, say, fp16 on a CPU before the run directory exists
    # A typo such as model.d_model=5120000: one line now, not torch's failed allocation after the data is read
    check_model_fits(cfg.model, cfg.tokenizer.vocab_size, machine_memory_bytes())
    if cfg.train.init_from and not args.resume:
        check_parent(cfg)  # so is a parent that cannot be started from: nothing created, nothing emptied
    check_freeze(cfg)  # and a train.freeze that leaves nothing to train
    dist = Distributed.from_environment()  # a world of one unless started by torchrun
    dist.start(device)
    with contextlib.ExitStack() as stack:  # left in reverse: train.log's last record, the run, the process group
        stack.callback(dist.stop)
        if dist.is_main:  # rank 0 prepares the directory; the others wait for it
            stack.enter_context(_claimed_run(run_dir, args, cfg.train.init_from))
        dist.barrier()
        stack.enter_context(_logging_to_train_log(run_dir, dist.is_main))
        stack.enter_context(_saying_how_to_continue(args, run_dir, torchrun=dist.enabled))
        state = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                      config_dir=args.config.resolve().parent, dist=dist)
    if not dist.is_main:
        return
    best = f", best validation BLEU {state.best_bleu:.2f}" if state.best_bleu >= 0 else ""
    print(f"tmt: finished at step {state.step}{best}; run directory {run_dir}", file=sys.stderr)


@contextlib.contextmanager
def _claimed_run(run_dir: Path, args: argparse.Namespace, init_from: str | None) -> Iterator[None]:
    """The run directory prepared for this start and locked while it trains. What a new start adds is
    taken back when it stops before training on its data, a setting refused once the model is built
    (train.freeze), a file it cannot write (a full disk, a file-size limit) or Ctrl-C: no run is left
    behind that never trained. Other failures keep the run's train.log, which records them."""
    from transformer_mt.runs.run_dir import NewRunDir, prepare_run_dir

    new_run = None if args.resume else NewRunDir(run_dir)
    try:
        lock = prepare_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite, init_from=init_from)
    except WriteError:  # a full disk before the lock was ours: what this start created goes too
        if new_run is not None:
            new_run.remove()
        raise
    with lock:
        try:
            yield
        except (ConfigError, DataError, WriteError, TrainingStopped, KeyboardInterrupt):
            if new_run is not None:
                new_run.remove()  # while the lock is still held
            raise


@contextlib.contextmanager
def _logging_to_train_log(run_dir: Path, is_main: bool) -> Iterator[None]:
    """Log lines with timestamps on the console and, on rank 0, into the run's train.log, which ends
    with the line that says why training stopped (a run read under nohup or in CI)."""
    log_file = setup_logging(logging.INFO if is_main else logging.WARNING,
                             RunDir(run_dir).train_log if is_main else None, timestamps=True)
    if log_file is None:
        yield
        return
    try:
        yield
    except BaseException as err:
        log_file.handle(_error_record(err))
        raise
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()


@contextlib.contextmanager
def _saying_how_to_continue(args: argparse.Namespace, run_dir: Path, torchrun: bool) -> Iterator[None]:
    """A stop of training (a signal, a time limit) as `TrainingStopped`, ending with the command that continues it."""
    from transformer_mt.runs.checkpoint import CheckpointDir

    try:
        yield
    except TrainingStopped as err:
        again = "the same torchrun command with --resume" if torchrun else _resume_command(args)
        raise TrainingStopped(f"{err}; continue with: {again}", err.exit_code - 128) from None
    except KeyboardInterrupt as err:  # a second Ctrl-C, or a signal outside the training loop
        signal_number = getattr(err, "exit_code", 128 + signal.SIGINT) - 128
        # Resume from the newest checkpoint, or before the first one start again (same directory).
        resume = CheckpointDir(RunDir(run_dir).checkpoints, keep_last=1).latest() is not None
        again = (f"the same torchrun command{' with --resume' if resume else ' (without --resume)'}"
                 if torchrun else _resume_command(args, resume=resume))
        raise TrainingStopped(f"{interrupted(signal_number)}; continue with: {again}", signal_number) from None


def _error_record(err: BaseException) -> logging.LogRecord:
    """The line `main` prints for what stops `tmt train` (with the traceback of an unexpected error),
    as a record for train.log: a warning for a stop the user asked for, an error otherwise."""
    if isinstance(err, TmtError):
        message, exc_info = error_line(err), None
    elif isinstance(err, KeyboardInterrupt):
        message, exc_info = f"tmt: {interrupted(getattr(err, 'exit_code', 128 + signal.SIGINT) - 128)}", None
    else:
        message, exc_info = f"tmt: internal error: {type(err).__name__}: {err}", (type(err), err, err.__traceback__)
    level = logging.WARNING if isinstance(err, (TrainingStopped, KeyboardInterrupt)) else logging.ERROR
    return logging.LogRecord(logger.name, level, __file__, 0, message, None, exc_info)


def _resume_command(args: argparse.Namespace, resume: bool = True) -> str:
    """The `tmt train` command with the same config, run directory and `--set` overrides that resumes
    the run (or with `resume=False`, starts it again)."""
    words = ["tmt", "train", "--config", str(args.config)]
    if args.run_dir:
        words += ["--run-dir", str(args.run_dir)]
    for override in args.overrides:
        words += ["--set", override]
    return shlex.join(words + ["--resume"] if resume else words)

