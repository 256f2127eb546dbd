"""The `tmt` command: parses argv (`cli.parser`), runs the subcommand, and turns every error into one
line and an exit code: 0 success, 2 bad config or arguments, 1 any other failure, 130 interrupted
(143 by SIGTERM)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import sys

from transformer_mt.cli.parser import build_parser
from transformer_mt.cli.average import run_average
from transformer_mt.cli.compare import run_compare
from transformer_mt.cli.data import run_data
from transformer_mt.cli.export import run_export
from transformer_mt.cli.import_model import run_import
from transformer_mt.cli.runs import run_runs
from transformer_mt.cli.score import run_score
from transformer_mt.cli.serve import run_serve
from transformer_mt.cli.train import run_train
from transformer_mt.cli.translate import run_evaluate, run_translate
from transformer_mt.core.errors import TmtError, TrainingStopped, error_line, interrupted
from transformer_mt.core.signals import sigterm_interrupts

logger = logging.getLogger("transformer_mt")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits with 2 on bad arguments
    try:
        commands = {"train": run_train, "data": run_data, "translate": run_translate, "evaluate": run_evaluate,
                    "export": run_export, "import": run_import, "average": run_average, "runs": run_runs,
                    "score": run_score, "compare": run_compare, "serve": run_serve}
        with sigterm_interrupts():  # SIGTERM ends any command as Ctrl-C does: one line, not a silent death
            commands[args.command](args)
        return 0
    except TmtError as err:
        if args.traceback:
            raise
        # Under torchrun every process is stopped alike (a signal reaches them all): rank 0 alone says it.
        _say(error_line(err), args, every_rank=not isinstance(err, TrainingStopped))
        return err.exit_code
    except BrokenPipeError:  # e.g. `tmt translate ... | head -1`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (`Terminated`)
        code = getattr(err, "exit_code", 128 + signal.SIGINT)
        _say(f"tmt: {interrupted(code - 128)}", args, every_rank=False)
        return code
    except Exception as err:  # an unexpected failure: one line, and the details on request
        if args.traceback:
            raise
        logger.debug("unexpected error", exc_info=True)
        # A collective operation failed because another process of the job ended, as gloo and NCCL say it
        # (not any distributed error: this rank's own failure must be shown as it is).
        signs = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                 "NCCL communicator was aborted")
        if _torchrun_rank(args) is not None and any(sign in str(err) for sign in signs):
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


def run() -> None:
    """The `tmt` command (`python -m transformer_mt` too): `main`, then an exit that a late Ctrl-C or
    SIGTERM ends at once with main's code, not with a traceback from inside an exit handler. A command
    stopped by a signal skips tearing the interpreter down (seconds on a busy machine): it ends at once."""
    code = main()
    _flush_std_streams()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signal_number, frame: os._exit(code))
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # what it saved is closed: `with`, `finally`
        atexit._run_exitfuncs()  # logging's last flush, multiprocessing's children: what `sys.exit` runs first
        _flush_std_streams()
        os._exit(code)
    sys.exit(code)


def _flush_std_streams() -> None:
    """What os._exit would otherwise drop."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that left, a closed stream
            stream.flush()
