"""The `tmt` command: argument parsing, logging setup, and the only place that prints.

Exit codes: 0 success, 2 bad config or arguments, 1 any other failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformer_mt import __version__
from transformer_mt.errors import TmtError, UsageError

logger = logging.getLogger("transformer_mt")

TRAIN_EXAMPLES = """examples:
  tmt train --config configs/demo.yaml
  tmt train --config configs/demo.yaml --set train.max_steps=2000 --set model.dropout=0.2
  tmt train --config configs/demo.yaml --resume        # continue from the newest checkpoint
  tensorboard --logdir runs                            # watch the curves
"""

TRANSLATE_EXAMPLES = """examples:
  tmt translate "Where is the station?"                 # newest run under ./runs
  tmt translate --run runs/demo "Good morning." "Thank you!"
  tmt translate --checkpoint runs/demo/checkpoints/step_00001000.pt < input.en > output.it
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tmt", description="Train Transformer translation models and translate with them.")
    parser.add_argument("--version", action="version", version=f"tmt {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a model from a YAML config",
                                epilog=TRAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", required=True, type=Path, help="YAML config file")
    train.add_argument("--run-dir", type=Path, help="where the run is written (default: runs/<name from config>)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.lr=3e-4 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    train.add_argument("--overwrite", action="store_true", help="delete an existing run in --run-dir and start over")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")

    translate = commands.add_parser("translate", help="translate sentences with a trained run",
                                    epilog=TRANSLATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    translate.add_argument("text", nargs="*", help="sentences to translate (default: one per line from stdin)")
    source = translate.add_mutually_exclusive_group()
    source.add_argument("--run", type=Path, help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint file inside a run's checkpoints/ folder")
    translate.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on bad arguments
    try:
        if args.command == "train":
            run_train(args)
        else:
            run_translate(args)
        return 0
    except TmtError as err:
        if args.traceback:
            raise
        print(f"tmt: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("tmt: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an unexpected failure: one line, and the details on request
        if args.traceback:
            raise
        logger.debug("unexpected error", exc_info=True)
        print(f"tmt: internal error: {type(err).__name__}: {err} (rerun with --traceback for details)",
              file=sys.stderr)
        return 1


def run_train(args: argparse.Namespace) -> None:
    from transformer_mt.config import load_config
    from transformer_mt.training import prepare_run_dir, train

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    prepare_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)
    log_file = _setup_logging(logging.INFO, run_dir / "train.log")
    try:
        state = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    best = f", best validation BLEU {state.best_bleu:.2f}" if state.best_bleu >= 0 else ""
    print(f"tmt: finished at step {state.step}{best}; run directory {run_dir}", file=sys.stderr)


def run_translate(args: argparse.Namespace) -> None:
    from transformer_mt.translator import Translator, latest_run

    _setup_logging(logging.WARNING)
    lines = args.text if args.text else _read_stdin_lines()
    if not lines:
        raise UsageError("nothing to translate: give sentences as arguments or one per line on stdin")
    if args.checkpoint:
        run_dir = args.checkpoint.resolve().parent.parent  # <run>/checkpoints/<file>.pt
        translator = Translator.from_run(run_dir, checkpoint=args.checkpoint, device=args.device)
    else:
        run_dir = args.run or latest_run(Path("runs"))
        translator = Translator.from_run(run_dir, device=args.device)
    for hypothesis in translator.translate(lines):
        print(hypothesis)


def _read_stdin_lines() -> list[str]:
    lines = []
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as err:
            raise UsageError(f"stdin line {number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return lines


def _setup_logging(level: int, log_path: Path | None = None) -> logging.Handler | None:
    """Log to stderr at `level`, and everything at INFO and above to `log_path` if given."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root.handlers = [console]
    for noisy in ("datasets", "urllib3", "filelock", "fsspec", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if log_path is None:
        return None
    file_handler = logging.FileHandler(log_path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    return file_handler
