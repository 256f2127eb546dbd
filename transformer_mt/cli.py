"""The `tmt` command: parses argv (`cli_parser`), runs the subcommand (`translate` and `evaluate` in
`cli_translate`), logs to the terminal (`cli_logging`); the command line is the only place that prints.

Exit codes: 0 success, 2 bad config or arguments, 1 any other failure, 130 interrupted (143 by SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from transformer_mt.cli_logging import setup_logging
from transformer_mt.cli_parser import build_parser
from transformer_mt.cli_translate import run_evaluate, run_translate
from transformer_mt.errors import CheckpointError, TmtError, TrainingStopped, UsageError
from transformer_mt.files import make_parent_dir
from transformer_mt.run_layout import RunDir
from transformer_mt.signals import sigterm_interrupts

logger = logging.getLogger("transformer_mt")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on bad arguments
    try:
        commands = {"train": run_train, "data": run_data, "translate": run_translate, "evaluate": run_evaluate,
                    "export": run_export, "average": run_average, "runs": run_runs}
        with sigterm_interrupts():  # SIGTERM ends any command as Ctrl-C does: one line, not a silent death
            commands[args.command](args)
        return 0
    except TmtError as err:
        if args.traceback:
            raise
        # Under torchrun every process is stopped alike (a signal reaches them all): rank 0 alone says it.
        _say(f"tmt: error: {err}", args, every_rank=not isinstance(err, TrainingStopped))
        return err.exit_code
    except BrokenPipeError:  # e.g. `tmt translate ... | head -1`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (`Terminated`)
        code = getattr(err, "exit_code", 128 + signal.SIGINT)
        by = "" if code == 128 + signal.SIGINT else f" by {signal.Signals(code - 128).name}"
        _say(f"tmt: interrupted{by}", args, every_rank=False)
        return code
    except Exception as err:  # an unexpected failure: one line, and the details on request
        if args.traceback:
            raise
        logger.debug("unexpected error", exc_info=True)
        if _torchrun_rank(args) is not None and _peer_stopped(err):  # not this process's failure: another's
            _say("tmt: error: another process of this torchrun job stopped (its own line, or torchrun's report, "
                 "says why), so this one stops too", args, every_rank=True)
            return 1
        _say(f"tmt: internal error: {type(err).__name__}: {err} (rerun as `tmt --traceback COMMAND ...` for details)",
             args, every_rank=True)
        return 1


def _torchrun_rank(args: argparse.Namespace) -> int | None:
    """This process's rank when torchrun started several to train, else None (no other command runs
    distributed, whatever RANK and WORLD_SIZE a launcher left in the environment)."""
    try:
        distributed = args.command == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1
        return int(os.environ["RANK"]) if distributed else None
    except (KeyError, ValueError):
        return None


def _say(line: str, args: argparse.Namespace, every_rank: bool) -> None:
    """`line` on stderr in one write (torchrun's processes share it: lines never interleave). Under
    torchrun a line every process says alike (a stop) is rank 0's alone, and another rank's line
    is named: an error that only some ranks meet (this machine's memory, say) is never lost."""
    rank = _torchrun_rank(args)
    if rank:
        if not every_rank:
            return
        line = line.replace("tmt:", f"tmt (rank {rank}):", 1)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _peer_stopped(err: Exception) -> bool:
    """A collective operation that failed because another process of the job ended, as gloo and
    NCCL say it (not any distributed error: this rank's own failure must be shown as it is)."""
    text = str(err)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "remote worker crashing", "NCCL communicator was aborted"))


def run() -> None:
    """The `tmt` command (`python -m transformer_mt` too): `main`, then an exit that a late signal
    cannot turn into a traceback."""
    code = main()
    _signals_end_the_exit_at_once(code)
    sys.exit(code)


def _signals_end_the_exit_at_once(code: int) -> None:
    """tmt has said all it will: a Ctrl-C or SIGTERM from here on (a second Ctrl-C after a stopped
    run, say) ends the process with `code` at once. Left to Python, it would raise KeyboardInterrupt
    inside an exit handler (torch's, `datasets`') and print a traceback under tmt's last line."""
    for stream in (sys.stdout, sys.stderr):  # what os._exit would otherwise drop
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing more to say
            pass
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signal_number, frame: os._exit(code))


def run_train(args: argparse.Namespace) -> None:
    from transformer_mt.batch_budget import check_model_fits
    from transformer_mt.config_loading import load_config
    from transformer_mt.distributed import Distributed
    from transformer_mt.init_from import check_parent
    from transformer_mt.runtime import machine_memory_bytes, pick_device, pick_precision
    from transformer_mt.run_dir import prepare_run_dir
    from transformer_mt.training import train

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    device = pick_device(cfg.train.device)
    pick_precision(cfg.train.precision, device)  # refuse, say, fp16 on a CPU before the run directory exists
    # A typo such as model.d_model=5120000: one line now, not torch's failed allocation after the data is read
    check_model_fits(cfg.model, cfg.tokenizer.vocab_size, machine_memory_bytes())
    if cfg.train.init_from and not args.resume:
        check_parent(cfg)  # so is a parent that cannot be started from: nothing created, nothing emptied
    dist = Distributed.from_environment()  # a world of one unless started by torchrun
    dist.start(device)
    lock = None  # rank 0's on the run directory, held while it trains
    try:
        if dist.is_main:  # rank 0 prepares the directory; the others wait for it
            lock = prepare_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite,
                                   init_from=cfg.train.init_from)
        dist.barrier()
        log_file = setup_logging(logging.INFO if dist.is_main else logging.WARNING,
                                  RunDir(run_dir).train_log if dist.is_main else None)
        try:
            try:
                state = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                              config_dir=args.config.resolve().parent, dist=dist)
            except TrainingStopped as err:
                again = "the same torchrun command with --resume" if dist.enabled else _resume_command(args)
                raise TrainingStopped(f"{err}; continue with: {again}", err.exit_code - 128) from None
            except KeyboardInterrupt as err:  # a second Ctrl-C, or a signal outside the training loop
                signal_number = getattr(err, "exit_code", 128 + signal.SIGINT) - 128
                raise TrainingStopped(f"interrupted by {signal.Signals(signal_number).name}; continue with: "
                                      f"{_continue_command(args, run_dir, dist.enabled)}",
                                      signal_number) from None
        except BaseException as err:
            if log_file is not None:  # a run read under nohup or in CI ends with why it stopped
                log_file.handle(_error_record(err))
            raise
        finally:
            if log_file is not None:
                logging.getLogger().removeHandler(log_file)
                log_file.close()
    finally:
        dist.stop()
        if lock is not None:
            lock.release()
    if not dist.is_main:
        return
    best = f", best validation BLEU {state.best_bleu:.2f}" if state.best_bleu >= 0 else ""
    print(f"tmt: finished at step {state.step}{best}; run directory {run_dir}", file=sys.stderr)


def _error_record(err: BaseException) -> logging.LogRecord:
    """A log record of the error that stops `tmt train`, for train.log: the line stderr shows
    (`main` prints it), and for an unexpected error its traceback as well."""
    if isinstance(err, TmtError):
        message, exc_info = f"tmt: error: {err}", None
    elif isinstance(err, KeyboardInterrupt):
        message, exc_info = "tmt: interrupted", None
    else:
        message, exc_info = f"tmt: internal error: {type(err).__name__}: {err}", (type(err), err, err.__traceback__)
    return logging.LogRecord(logger.name, logging.ERROR, __file__, 0, message, None, exc_info)


def _resume_command(args: argparse.Namespace, resume: bool = True) -> str:
    """The `tmt train` command that continues an interrupted run: the same config, run directory
    and `--set` overrides (without them a resume would see a different config), plus --resume;
    without it (`resume=False`), the command that starts the run again."""
    words = ["tmt", "train", "--config", str(args.config)]
    if args.run_dir:
        words += ["--run-dir", str(args.run_dir)]
    for override in args.overrides:
        words += ["--set", override]
    return shlex.join(words + ["--resume"] if resume else words)


def _continue_command(args: argparse.Namespace, run_dir: Path, torchrun: bool) -> str:
    """How to go on after an interruption: resume from the run's newest checkpoint, or, before the
    first one, start again (a start that stopped early reuses its run directory)."""
    from transformer_mt.checkpoint import CheckpointDir

    resume = CheckpointDir(RunDir(run_dir).checkpoints, keep_last=1).latest() is not None
    if torchrun:
        return "the same torchrun command" + (" with --resume" if resume else " (without --resume)")
    return _resume_command(args, resume=resume)


def run_data(args: argparse.Namespace) -> None:
    """Print the data report of a config without training, leaving no file behind
    (`preparation.preview_report`: with an existing run's tokenizers when they fit)."""
    from transformer_mt.config_loading import load_config
    from transformer_mt.init_from import check_parent
    from transformer_mt.preparation import preview_report
    from transformer_mt.run_dir import data_settings_problem
    from transformer_mt.run_files import run_dir_problem

    setup_logging(logging.WARNING)
    cfg = load_config(args.config, args.overrides)
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


def run_export(args: argparse.Namespace) -> None:
    from transformer_mt.export import export_ctranslate2

    setup_logging(logging.INFO)
    export_ctranslate2(args.run, args.output, args.checkpoint, args.quantization)


def run_runs(args: argparse.Namespace) -> None:
    from transformer_mt.summary import read_summaries, runs_table

    if args.dir is not None and not args.dir.is_dir():  # a typo must not read as "no runs yet"
        raise UsageError(f"--dir {args.dir}: {'not a folder' if args.dir.exists() else 'no such folder'}")
    folder = args.dir or Path("runs")
    rows = read_summaries(folder)
    print(runs_table(rows))  # with no runs, the header alone: scripts read an empty table, not an error
    if not rows:
        print(f"tmt: no runs with a summary.json under {folder} (train one with `tmt train`, or pass --dir)",
              file=sys.stderr)


def run_average(args: argparse.Namespace) -> None:
    from transformer_mt.checkpoint import CheckpointDir, average_checkpoints, is_average_checkpoint, save_atomic
    from transformer_mt.run_files import find_checkpoint
    from transformer_mt.run_lock import lock_if_inside

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
