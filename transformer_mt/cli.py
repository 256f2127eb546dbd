"""The `tmt` command: argument parsing, logging setup, and the only place that prints.

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

from transformer_mt import __version__
from transformer_mt.config import BLEU_TOKENIZERS, Config
from transformer_mt.errors import DataError, TmtError, TrainingStopped, UsageError
from transformer_mt.files import check_parent_dir, lines_to_text, make_parent_dir, write_text_atomic

logger = logging.getLogger("transformer_mt")
STDIO = "-"  # `tmt translate --input -` / `--output -`: stdin / stdout, as in most command-line tools

MAIN_EXAMPLES = """a first run (CPU, a few minutes):
  tmt data --config configs/demo.yaml                   # look at the data first: pairs, lengths, steps per epoch
  tmt train --config configs/demo.yaml                  # train on the bundled English-Italian corpus
  tensorboard --logdir runs                             # curves, example translations, attention
  tmt translate "Where is the station?"                 # translate with the newest run
  tmt evaluate --run runs/demo --beam 5                 # BLEU and chrF on the test split
  tmt runs                                              # every run: status, steps, BLEU

`tmt COMMAND --help` shows each command's options and examples.
"""

TRAIN_EXAMPLES = """examples:
  tmt train --config configs/demo.yaml
  tmt train --config configs/demo.yaml --set train.max_steps=2000 --set model.dropout=0.2
  tmt train --config configs/demo.yaml --resume        # continue from the newest checkpoint
  tensorboard --logdir runs                            # watch the curves
"""

DATA_EXAMPLES = """examples:
  tmt data --config configs/demo.yaml                   # the report tmt train logs before its first step
  tmt data --config configs/demo.yaml --set tokenizer.vocab_size=2000 --set model.max_len=32
  tmt data --config configs/en-it.yaml --set train.batch_tokens=8192   # steps per epoch at another budget

Nothing is written: tokenizers are trained in a temporary folder, or reused from the run
directory (--run-dir, default runs/<name>) when its data and tokenizer settings are the same.
"""

TRANSLATE_EXAMPLES = """examples:
  tmt translate "Where is the station?"                 # newest run under ./runs
  tmt translate --run runs/demo "Good morning." "Thank you!"
  tmt translate --run runs/demo --beam 5 --input test.en --output test.it
  tmt translate --checkpoint runs/demo/checkpoints/step_00001000.pt < input.en > output.it
  tmt translate --run runs/demo --show-attention attention.png "Where is the station?"
"""

EVALUATE_EXAMPLES = """examples:
  tmt evaluate --run runs/demo                          # the run's test split, greedy
  tmt evaluate --run runs/demo --split valid --beam 5
  tmt evaluate --run runs/m30k --src test.en --ref test.de --tokenize none   # pre-tokenized text
"""


EXPORT_EXAMPLES = """examples:
  pip install ctranslate2
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2-int8 --quantization int8
"""


RUNS_EXAMPLES = """examples:
  tmt runs                                              # the runs under ./runs, newest first
  tmt runs --dir /data/experiments
  cat runs/demo/summary.json                            # one run's provenance, metrics and throughput
"""

AVERAGE_EXAMPLES = """examples:
  tmt average --run runs/m30k                           # the last 5 step checkpoints
  tmt average --run runs/demo --last 2                  # the demo keeps 2 (train.keep_last)
  tmt evaluate --checkpoint runs/demo/checkpoints/average_steps_00001000-00001200.pt --beam 5
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tmt", description="Train Transformer translation models and translate with them.",
                                     epilog=MAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    train.add_argument("--quiet", "--no-progress", dest="no_progress", action="store_true",
                       help="no progress bars (the log lines stay)")

    data = commands.add_parser("data", help="report on the data before training: pairs, filters, lengths, "
                                             "unknown tokens, steps per epoch",
                               epilog=DATA_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_argument("--config", required=True, type=Path, help="YAML config file")
    data.add_argument("--run-dir", type=Path, help="a run whose tokenizers and data split to reuse, read only "
                                                   "(default: runs/<name from config>, if it exists)")
    data.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set model.max_len=64 (repeatable)")
    data.add_argument("--quiet", action="store_true", help="no progress bars")

    translate = commands.add_parser("translate", help="translate sentences with a trained run",
                                    epilog=TRANSLATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    translate.add_argument("text", nargs="*", help="sentences to translate (default: one per line from stdin)")
    _add_model_arguments(translate)
    translate.add_argument("--input", type=_path_or_dash, help="translate this file, one sentence per line (- = stdin)")
    translate.add_argument("--output", type=_path_or_dash,
                           help="write translations here instead of stdout (- = stdout)")
    translate.add_argument("--show-attention", type=Path, metavar="FILE.png",
                           help="draw the cross-attention of the (single) sentence's translation to FILE.png")
    translate.add_argument("--attention-layer", type=int, default=-1, metavar="N",
                           help="decoder layer to draw for --show-attention: 0 is the first, -1 (default) the last")

    evaluate = commands.add_parser("evaluate", help="translate a test set and score it with sacreBLEU",
                                   epilog=EVALUATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_arguments(evaluate)
    evaluate.add_argument("--split", choices=["valid", "test"], default="test",
                          help="which split of the run's own data to score (default: test)")
    evaluate.add_argument("--src", type=Path, help="source file to translate instead of a split (needs --ref)")
    evaluate.add_argument("--ref", type=Path, help="reference translations of --src, line by line")
    evaluate.add_argument("--tokenize", choices=BLEU_TOKENIZERS, help="sacreBLEU tokenizer for BLEU (default: the run's train.bleu_tokenize, "
                                             "normally 13a; 'none' for pre-tokenized text)")
    evaluate.add_argument("--output", type=_path_or_dash,
                          help="where to write the hypotheses "
                               "(default: <run>/evaluation/<name>.<checkpoint>.beam<K>[.lp<ALPHA>].txt)")

    export = commands.add_parser("export", help="export a trained run to another inference engine",
                                 epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("--format", choices=["ctranslate2"], required=True)
    export.add_argument("--run", type=Path, required=True, help="run directory")
    export.add_argument("--output", type=Path, required=True, help="new model directory to write")
    export.add_argument("--checkpoint", type=Path, help="default: best.pt, else the newest step checkpoint")
    export.add_argument("--quantization", help="CTranslate2 weight type: int8, int8_float16, float16, ... "
                                               "(default: float32)")

    runs = commands.add_parser("runs", help="list training runs: status, steps, best BLEU, last update",
                               epilog=RUNS_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    runs.add_argument("--dir", type=Path, default=Path("runs"),
                      help="folder holding run directories, also grouped one folder deeper (runs/<group>/<name>), "
                           "or one run directory (default: runs)")

    average = commands.add_parser("average", help="average the weights of a run's last step checkpoints",
                                  epilog=AVERAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    average.add_argument("--run", type=Path, required=True, help="run directory")
    average.add_argument("--last", type=_positive_int, default=5, metavar="N",
                         help="how many of the newest step checkpoints to average (default 5)")
    average.add_argument("--output", type=Path,
                         help="default: <run>/checkpoints/average_steps_<first>-<last>.pt (keep it in "
                              "<run>/checkpoints/ so that --checkpoint finds the run's tokenizers)")
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--run / --checkpoint, --beam, --length-penalty and --device, shared by translate and evaluate."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run", type=Path, help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint file inside a run's checkpoints/ folder")
    parser.add_argument("--beam", type=_positive_int, metavar="K",
                        help="beam size (default: the run's decode.beam_size; 1 = greedy)")
    parser.add_argument("--length-penalty", type=_non_negative_float, metavar="ALPHA",
                        help="beam search's length penalty α (default: the run's decode.length_penalty; "
                             "0 = none, higher favours longer translations)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="where to translate (default auto: CUDA, else MPS, else the CPU; another GPU: "
                             "CUDA_VISIBLE_DEVICES=N)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _path_or_dash(text: str) -> Path | str:
    """A path, or `STDIO` for exactly "-" (so that `./-` still names a file called -)."""
    return STDIO if text == STDIO else Path(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on bad arguments
    try:
        {"train": run_train, "data": run_data, "translate": run_translate, "evaluate": run_evaluate, "export": run_export,
         "average": run_average,
         "runs": run_runs}[args.command](args)
        return 0
    except TmtError as err:
        if args.traceback:
            raise
        print(f"tmt: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # e.g. `tmt translate ... | head -1`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except KeyboardInterrupt:
        print("tmt: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an unexpected failure: one line, and the details on request
        if args.traceback:
            raise
        logger.debug("unexpected error", exc_info=True)
        print(f"tmt: internal error: {type(err).__name__}: {err} (rerun as `tmt --traceback COMMAND ...` for details)",
              file=sys.stderr)
        return 1


def run_train(args: argparse.Namespace) -> None:
    from transformer_mt.config import load_config
    from transformer_mt.distributed import Distributed
    from transformer_mt.runtime import pick_device, pick_precision
    from transformer_mt.run_dir import prepare_run_dir
    from transformer_mt.training import train

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    device = pick_device(cfg.train.device)
    pick_precision(cfg.train.precision, device)  # refuse, say, fp16 on a CPU before the run directory exists
    dist = Distributed.from_environment()  # a world of one unless started by torchrun
    dist.start(device)
    try:
        if dist.is_main:  # rank 0 prepares the directory; the others wait for it
            prepare_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)
        dist.barrier()
        log_file = _setup_logging(logging.INFO if dist.is_main else logging.WARNING,
                                  run_dir / "train.log" if dist.is_main else None)
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
        finally:
            if log_file is not None:
                logging.getLogger().removeHandler(log_file)
                log_file.close()
    finally:
        dist.stop()
    if not dist.is_main:
        return
    best = f", best validation BLEU {state.best_bleu:.2f}" if state.best_bleu >= 0 else ""
    print(f"tmt: finished at step {state.step}{best}; run directory {run_dir}", file=sys.stderr)


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

    resume = CheckpointDir(run_dir / "checkpoints", keep_last=1).latest() is not None
    if torchrun:
        return "the same torchrun command" + (" with --resume" if resume else " (without --resume)")
    return _resume_command(args, resume=resume)


def run_data(args: argparse.Namespace) -> None:
    """Print the data report of a config without training, leaving no file behind.

    The corpus is loaded and the tokenizers trained in a temporary folder; an existing run's
    tokenizers and carved split (`splits.json`) are copied there first when the run was made
    from the same seed, data and tokenizer settings, so the report describes that run.
    """
    import shutil
    import tempfile

    from transformer_mt.config import load_config
    from transformer_mt.data import SPLITS_FILE
    from transformer_mt.tokenization import JOINT_FILE, SRC_FILE, TGT_FILE
    from transformer_mt.runtime import pick_device
    from transformer_mt.preparation import batch_padding, prepare_data

    _setup_logging(logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    reuse = _same_data_settings(cfg, run_dir)
    with tempfile.TemporaryDirectory(prefix="tmt-data-") as scratch:
        if reuse:
            for name in (SPLITS_FILE, JOINT_FILE, SRC_FILE, TGT_FILE):
                if (run_dir / name).is_file():
                    shutil.copyfile(run_dir / name, Path(scratch) / name)
        device_type = cfg.train.device if cfg.train.device != "auto" else pick_device().type
        try:
            *_, report = prepare_data(cfg, Path(scratch), progress=not args.quiet,
                                      pad_to_multiple=batch_padding(cfg.train, device_type))
        except TmtError as err:  # name the run's file (a damaged splits.json, say), not its scratch copy
            err.args = tuple(str(arg).replace(scratch, str(run_dir)) for arg in err.args)
            raise
    print(report.render())
    source = f"the tokenizers of {run_dir}" if reuse else "tokenizers trained for this report (not saved)"
    print(f"tmt: data report of {args.config} with {source}", file=sys.stderr)


def _same_data_settings(cfg: Config, run_dir: Path) -> bool:
    """True when `run_dir` holds a run made with the seed, data and tokenizer settings of `cfg`."""
    from transformer_mt.config import config_to_dict, load_config
    from transformer_mt.tokenization import TokenizerPair

    if not (run_dir / "config.yaml").is_file() or not TokenizerPair.exists_in(run_dir):
        return False
    try:
        saved = config_to_dict(load_config(run_dir / "config.yaml"))
    except TmtError:
        return False  # an unreadable config: train fresh tokenizers rather than guess
    current = config_to_dict(cfg)
    return all(saved[key] == current[key] for key in ("seed", "data", "tokenizer"))


def run_translate(args: argparse.Namespace) -> None:
    _setup_logging(logging.WARNING)
    if args.text and args.input:
        raise UsageError("give sentences as arguments or --input FILE, not both")
    if args.input == STDIO:
        args.input = None  # `--input -`: stdin, as without --input
    if args.output == STDIO:
        args.output = None  # `--output -`: stdout, as without --output
    if args.input:
        lines = _read_file_lines(args.input)
    else:
        lines = _argument_lines(args.text) if args.text else _read_stdin_lines()
        if not lines:
            raise UsageError("nothing to translate: give sentences as arguments, --input FILE, "
                             "or one per line on stdin")
    if args.show_attention:
        _check_attention_arguments(args, lines)
    _check_output(args.output, inputs={"--input": args.input})
    _check_output(args.show_attention, "--show-attention", inputs={"--input": args.input})
    translator = _load_translator(args)
    if args.show_attention:
        hypotheses = [_draw_attention(translator, lines[0], args)]
    else:
        hypotheses = translator.translate(lines, beam_size=args.beam, progress=bool(args.input) and not args.quiet)
    if args.output:
        _write_lines(args.output, hypotheses)
    else:
        for hypothesis in hypotheses:
            print(hypothesis)
        sys.stdout.flush()  # a closed pipe fails here, inside main's error handling, not at exit


def _check_attention_arguments(args: argparse.Namespace, lines: list[str]) -> None:
    """--show-attention needs exactly one non-empty sentence, and a file of its own."""
    if len(lines) != 1:
        raise UsageError(f"--show-attention draws one sentence; got {len(lines)}")
    if not lines[0].strip():
        raise UsageError("--show-attention: the sentence is empty; there is no attention to draw")
    if args.output and args.output.resolve() == args.show_attention.resolve():
        raise UsageError(f"--output and --show-attention are the same file ({args.output}); give two names")


def _draw_attention(translator, line: str, args: argparse.Namespace) -> str:
    """Draw `line`'s cross-attention to --show-attention and return its translation."""
    from transformer_mt.plotting import save_attention_png

    n_layers = translator.model.cfg.n_layers
    if not -n_layers <= args.attention_layer < n_layers:
        raise UsageError(f"--attention-layer {args.attention_layer}: the model has {n_layers} decoder layers "
                         f"(0..{n_layers - 1}, or -1 for the last)")
    attention = translator.attention(line, layer=args.attention_layer, beam_size=args.beam)
    layer = args.attention_layer % n_layers
    try:
        save_attention_png(args.show_attention, attention.weights, attention.src_pieces, attention.tgt_pieces,
                           f"cross-attention, decoder layer {layer + 1} of {n_layers}, mean over heads")
    except OSError as err:
        raise TmtError(f"cannot write {args.show_attention} ({err.strerror or err})") from None
    print(f"attention drawn to {args.show_attention}", file=sys.stderr)
    return attention.translation


def run_evaluate(args: argparse.Namespace) -> None:
    from transformer_mt.data import load_run_corpus
    from transformer_mt.data_sources import read_aligned_files
    from transformer_mt.evaluation import bleu_tokenizer_problem, score

    _setup_logging(logging.WARNING)
    if bool(args.src) != bool(args.ref):
        raise UsageError("--src and --ref go together")
    if args.output == STDIO:
        raise UsageError("--output -: evaluate prints its scores on stdout; give a file for the hypotheses")
    _check_output(args.output, inputs={"--src": args.src, "--ref": args.ref})
    translator = _load_translator(args)
    tokenize = args.tokenize or translator.cfg.train.bleu_tokenize
    problem = bleu_tokenizer_problem(tokenize)  # before translating
    if problem:
        where = "--tokenize" if args.tokenize else "the run's train.bleu_tokenize (choose another with --tokenize)"
        raise UsageError(f"{where}: {problem}")
    if args.src:
        pairs = read_aligned_files(args.src, args.ref)
        if not any(src.strip() for src, _ in pairs):  # no lines, or only empty ones: BLEU 0 of nothing
            raise UsageError(f"{args.src}: no sentences to evaluate (the file is empty or every line is blank)")
        sources, references = [src for src, _ in pairs], [ref for _, ref in pairs]
        name = f"file-{args.src.name}"  # never a split's name: the final test's hypotheses are test.*
    else:
        # The split as the run read it (its corpus_cache/), even if the data files moved or changed since
        corpus = load_run_corpus(translator.cfg.data, translator.cfg.seed, translator.run_dir)
        split = getattr(corpus, args.split)
        sources, references, name = split["src"], split["tgt"], args.split
    beam = args.beam or translator.cfg.decode.beam_size
    hypotheses = translator.translate(sources, beam_size=beam, progress=not args.quiet)
    scores = score(hypotheses, references, tokenize=tokenize)
    # Named after the checkpoint (and a --length-penalty, with a beam), like the final
    # test's file: scoring another checkpoint or setting never overwrites the hypotheses behind
    # the run's own evaluation/test_scores.json.
    alpha = translator.cfg.decode.length_penalty
    settings = f"beam{beam}" + (f".lp{alpha:g}" if args.length_penalty is not None and beam > 1 else "")
    output = args.output or translator.run_dir / "evaluation" / f"{name}.{translator.checkpoint.stem}.{settings}.txt"
    _write_lines(output, hypotheses)
    print(f"BLEU = {scores.bleu:.2f}  {scores.bleu_signature}")
    print(f"chrF = {scores.chrf:.2f}  {scores.chrf_signature}")
    penalty = f", length penalty {alpha:g}" if beam > 1 else ""  # greedy decoding has none
    print(f"{len(hypotheses)} sentences, beam {beam}{penalty}; hypotheses in {output}", file=sys.stderr)


def run_export(args: argparse.Namespace) -> None:
    from transformer_mt.export import export_ctranslate2

    _setup_logging(logging.INFO)
    export_ctranslate2(args.run, args.output, args.checkpoint, args.quantization)


def run_runs(args: argparse.Namespace) -> None:
    from transformer_mt.summary import read_summaries, runs_table

    rows = read_summaries(args.dir)
    if not rows:
        raise TmtError(f"no runs with a summary.json under {args.dir} (train one with `tmt train`, or pass --dir)")
    print(runs_table(rows))


def run_average(args: argparse.Namespace) -> None:
    from transformer_mt.checkpoint import CheckpointDir, average_checkpoints, is_average_checkpoint, save_atomic

    _setup_logging(logging.INFO)
    checkpoints = CheckpointDir(args.run / "checkpoints", keep_last=1)
    if not checkpoints.directory.is_dir():
        raise UsageError(f"--run {args.run}: no checkpoints folder there; is it a tmt run directory?")
    steps = checkpoints.steps()
    if len(steps) < args.last:
        raise UsageError(f"{args.run}: {len(steps)} step checkpoint(s) on disk, fewer than --last {args.last} "
                         "(train.keep_last sets how many a run keeps)")
    steps = steps[-args.last:]
    output = args.output or checkpoints.directory / f"average_steps_{steps[0]:08d}-{steps[-1]:08d}.pt"
    # Re-running an average may replace its earlier output, and only that: a file of the name
    # tmt gives averages that holds a checkpoint tmt average wrote, never a user's file so named.
    if output.is_dir() or (output.exists() and not (output.name.startswith("average_steps_")
                                                    and is_average_checkpoint(output))):
        raise UsageError(f"--output {output} already exists; tmt average replaces only an average it wrote "
                         "earlier (average_steps_*.pt): choose a new file name")
    make_parent_dir(output, "--output" if args.output else None)
    save_atomic(average_checkpoints([checkpoints.step_path(step) for step in steps]), output)
    print(f"averaged steps {', '.join(map(str, steps))} into {output}", file=sys.stderr)


def _load_translator(args: argparse.Namespace):
    from transformer_mt.translator import Translator, latest_run

    if args.checkpoint:
        if args.checkpoint.resolve().parent.name != "checkpoints":
            raise UsageError(f"--checkpoint {args.checkpoint}: give a checkpoint inside a run's checkpoints/ "
                             "folder (the run's tokenizers and config are found from there)")
        run_dir = args.checkpoint.resolve().parent.parent  # <run>/checkpoints/<file>.pt
        translator = Translator.from_run(run_dir, checkpoint=args.checkpoint, device=args.device)
    else:
        translator = Translator.from_run(args.run or latest_run(Path("runs")), device=args.device)
    if args.length_penalty is not None:
        translator.set_decoding(length_penalty=args.length_penalty)
    return translator


def _read_file_lines(path: Path) -> list[str]:
    from transformer_mt.data_sources import read_lines

    return read_lines(path)


def _check_output(path: Path | None, option: str = "--output", inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse, before translating rather than after, an output that cannot be a file or that is
    one of the command's `inputs` (option -> path): writing it would destroy what was read, or
    that lies under a file (`in.txt/out.txt`). Creates nothing: the writer makes the folder."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    for name, source in (inputs or {}).items():
        if source is not None and path.exists() and source.exists() and os.path.samefile(path, source):
            raise UsageError(f"{option} {path} is the {name} file; writing it would destroy the input")
    check_parent_dir(path, option)


def _write_lines(path: Path, lines: list[str]) -> None:
    """Write one line each, atomically: a failure never leaves a half-written file."""
    make_parent_dir(path)
    try:
        write_text_atomic(path, lines_to_text(lines))
    except OSError as err:
        raise TmtError(f"cannot write {path} ({err.strerror or err})") from None


def _argument_lines(texts: list[str]) -> list[str]:
    """Sentences given as arguments. Python passes on bytes that are not UTF-8 as lone surrogates
    (`os.fsdecode`), which no tokenizer takes: name the argument instead."""
    for number, text in enumerate(texts, start=1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"sentence argument {number}: not valid UTF-8 (after {text[:err.start]!r}); "
                            "check the terminal's encoding, or pass the text with --input FILE") from None
    return texts


def _read_stdin_lines() -> list[str]:
    from transformer_mt.data_sources import refuse_cr_line_breaks

    lines = []
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        if number == 1:
            refuse_cr_line_breaks("stdin", raw)  # as the file readers do
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
            lines.append(line.removeprefix("\ufeff") if number == 1 else line)  # a byte-order mark is not text
        except UnicodeDecodeError as err:
            raise DataError(f"stdin line {number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
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
