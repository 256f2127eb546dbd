"""The `tmt` command: parses argv (`cli_parser`), runs the subcommand, sets up logging; the only place that prints.

Exit codes: 0 success, 2 bad config or arguments, 1 any other failure, 130 interrupted (143 by SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from transformer_mt.cli_parser import STDIO, build_parser, check_translate_options, numpy_engine_refusal
from transformer_mt.errors import DataError, TmtError, TrainingStopped, UsageError
from transformer_mt.files import check_parent_dir, lines_to_text, make_parent_dir, write_text_atomic
from transformer_mt.optional_outputs import OptionalFileHandler
from transformer_mt.run_layout import RunDir

logger = logging.getLogger("transformer_mt")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on bad arguments
    try:
        commands = {"train": run_train, "data": run_data, "translate": run_translate, "evaluate": run_evaluate,
                    "export": run_export, "average": run_average, "runs": run_runs}
        commands[args.command](args)
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
    from transformer_mt.config_loading import load_config
    from transformer_mt.distributed import Distributed
    from transformer_mt.init_from import check_parent
    from transformer_mt.runtime import pick_device, pick_precision
    from transformer_mt.run_dir import prepare_run_dir
    from transformer_mt.training import train

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    device = pick_device(cfg.train.device)
    pick_precision(cfg.train.precision, device)  # refuse, say, fp16 on a CPU before the run directory exists
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
        log_file = _setup_logging(logging.INFO if dist.is_main else logging.WARNING,
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

    _setup_logging(logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or Path("runs") / cfg.name
    if cfg.train.init_from:
        check_parent(cfg)  # a config `tmt train` would refuse gets no report
    report, notes, reuse = preview_report(cfg, run_dir, progress=not args.quiet)
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


def run_translate(args: argparse.Namespace) -> None:
    from transformer_mt.data_sources import read_lines, read_stream_lines

    _setup_logging(logging.WARNING)
    if args.text and args.input:
        raise UsageError("give sentences as arguments or --input FILE, not both")
    check_translate_options(args)
    # Typing at a terminal with nothing else to read or write: translate each line as it comes.
    interactive = args.interactive or (not args.text and args.input is None and args.output is None
                                       and args.show_attention is None and sys.stdin.isatty())
    if args.input == STDIO:
        args.input = None  # `--input -`: stdin, as without --input
    if args.output == STDIO:
        args.output = None  # `--output -`: stdout, as without --output
    if interactive:
        _translate_interactively(_load_translator(args), args)
        return
    if args.input:
        lines = read_lines(args.input)
    else:
        lines = _argument_lines(args.text) if args.text else read_stream_lines(sys.stdin.buffer, "stdin")
        if not lines:
            raise UsageError("nothing to translate: give sentences as arguments, --input FILE, "
                             "or one per line on stdin")
    if args.show_attention:
        _check_attention_arguments(args, lines)
    _check_output(args.output, inputs={"--input": args.input})
    _check_output(args.show_attention, "--show-attention", inputs={"--input": args.input})
    translator = _load_translator(args)
    if args.show_attention:
        outputs = [_draw_attention(translator, lines[0], args)]
    else:
        outputs = _translate_lines(translator, lines, args, progress=bool(args.input) and not args.quiet)
    if args.output:
        _write_lines(args.output, outputs)
    else:
        for output in outputs:
            print(output)
        sys.stdout.flush()  # a closed pipe fails here, inside main's error handling, not at exit


def _translate_lines(translator, lines: list[str], args: argparse.Namespace, progress: bool,
                     first_number: int = 0) -> list[str]:
    """The output lines for `lines`: one translation each, or with --n-best, --scores, --format
    jsonl or --sample, the lists README's "n-best lists and scores" describes (sentences
    numbered from `first_number`)."""
    if args.n_best == 1 and not args.scores and args.format == "text" and not args.sample:
        return translator.translate(lines, beam_size=args.beam, progress=progress)  # no torch import for numpy's
    from transformer_mt.decoding import Sampling
    from transformer_mt.translator import format_translations

    beam = args.beam or translator.cfg.decode.beam_size
    if not args.sample and args.n_best > beam:  # the run's beam size, when --beam was left out
        raise UsageError(f"--n-best {args.n_best}: beam search keeps only the run's decode.beam_size={beam} "
                         f"translations; add --beam {args.n_best} or more")
    sampling = Sampling(temperature=args.temperature or 1.0, top_k=args.top_k or 0,
                        top_p=args.top_p or 1.0, seed=args.seed or 0) if args.sample else None
    results = translator.translate_n_best(lines, n_best=args.n_best, beam_size=1 if args.sample else beam,
                                          sampling=sampling, progress=progress)
    return format_translations(lines, results, jsonl=args.format == "jsonl", numbered=args.n_best > 1,
                               scores=args.scores, first_number=first_number)


def _translate_interactively(translator, args: argparse.Namespace) -> None:
    """A prompt; each line is translated as soon as it is entered (the model loaded once), its
    output on stdout at once. Ctrl-D (end of input) ends it."""
    data = translator.cfg.data
    at_terminal = sys.stdin.isatty()
    if at_terminal:
        print(f"tmt: translating {data.src_lang}->{data.tgt_lang} with {_shown(translator.checkpoint)}, a line at a "
              "time; Ctrl-D to quit", file=sys.stderr)
    number = 0
    while (line := _prompt(f"{data.src_lang}> " if at_terminal else "", number + 1)) is not None:
        for output in _translate_lines(translator, [line], args, progress=False, first_number=number):
            print(output)
        sys.stdout.flush()
        number += 1


def _prompt(prompt: str, number: int) -> str | None:
    """The next line from stdin, after `prompt` on the terminal; None at the end of input."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        with contextlib.suppress(ImportError):  # no readline on Windows
            import readline  # noqa: F401  (input() then offers line editing and history)
        try:
            return input(prompt)
        except EOFError:
            print(file=sys.stderr)  # the shell's prompt then starts on a line of its own
            return None
    if prompt:  # stdout is a file or a pipe: keep it for translations
        print(prompt, end="", file=sys.stderr, flush=True)
    from transformer_mt.data_sources import decode_line

    raw = sys.stdin.buffer.readline()
    return decode_line(raw, "stdin", number) if raw else None


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
    from transformer_mt.plotting import save_attention

    n_layers = translator.model.cfg.n_decoder_layers
    if not -n_layers <= args.attention_layer < n_layers:
        raise UsageError(f"--attention-layer {args.attention_layer}: the model has {n_layers} decoder layers "
                         f"(0..{n_layers - 1}, or -1 for the last)")
    attention = translator.attention(line, layer=args.attention_layer, beam_size=args.beam)
    layer = args.attention_layer % n_layers
    try:
        save_attention(args.show_attention, attention.weights, attention.src_pieces, attention.tgt_pieces,
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
    settings = f"beam{beam}" + (f".lp{alpha:g}" if args.length_penalty is not None and beam > 1 else "") + \
        (f".{translator.quantized}" if translator.quantized else "")  # never replacing the fp32 hypotheses
    output = args.output or RunDir(translator.run_dir).evaluation / f"{name}.{translator.checkpoint.stem}.{settings}.txt"
    _write_lines(output, hypotheses)
    print(f"BLEU = {scores.bleu:.2f}  {scores.bleu_signature}")
    print(f"chrF = {scores.chrf:.2f}  {scores.chrf_signature}")
    penalty = f", length penalty {alpha:g}" if beam > 1 else ""  # greedy decoding has none
    penalty += f", {translator.quantized} weights" if translator.quantized else ""
    print(f"{len(hypotheses)} sentences, beam {beam}{penalty}; hypotheses in {_shown(output)}", file=sys.stderr)


def run_export(args: argparse.Namespace) -> None:
    from transformer_mt.export import export_ctranslate2

    _setup_logging(logging.INFO)
    export_ctranslate2(args.run, args.output, args.checkpoint, args.quantization)


def run_runs(args: argparse.Namespace) -> None:
    from transformer_mt.summary import read_summaries, runs_table

    rows = read_summaries(args.dir)
    print(runs_table(rows))  # with no runs, the header alone: scripts read an empty table, not an error
    if not rows:
        print(f"tmt: no runs with a summary.json under {args.dir} (train one with `tmt train`, or pass --dir)",
              file=sys.stderr)


def run_average(args: argparse.Namespace) -> None:
    from transformer_mt.checkpoint import CheckpointDir, average_checkpoints, is_average_checkpoint, save_atomic
    from transformer_mt.run_lock import lock_if_inside

    _setup_logging(logging.INFO)
    checkpoints = CheckpointDir(RunDir(args.run).checkpoints, keep_last=1)
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
    with lock_if_inside(args.run, output, "tmt average"):  # never beside the run's trainer
        save_atomic(average_checkpoints([checkpoints.step_path(step) for step in steps]), output)
    print(f"averaged steps {', '.join(map(str, steps))} into {output}", file=sys.stderr)


def _load_translator(args: argparse.Namespace):
    from transformer_mt.run_files import latest_run

    if args.checkpoint:
        if args.checkpoint.resolve().parent.name != RunDir.CHECKPOINTS:
            raise UsageError(f"--checkpoint {args.checkpoint}: give a checkpoint inside a run's checkpoints/ "
                             "folder (the run's tokenizers and config are found from there)")
        run_dir = args.checkpoint.resolve().parent.parent  # <run>/checkpoints/<file>.pt
        translator = _open_translator(args, run_dir, args.checkpoint)
    elif args.run:
        translator = _open_translator(args, args.run, None)
    else:  # say which run answers: the newest run may be of another language pair than the user thinks
        run_dir = latest_run(Path("runs"))
        translator = _open_translator(args, run_dir, None)
        data = translator.cfg.data
        print(f"tmt: using {_shown(run_dir)} ({data.src_lang}->{data.tgt_lang}, {translator.checkpoint.name}), "
              "the most recently updated run under runs/; choose another with --run DIR (`tmt runs` lists them)",
              file=sys.stderr)
    chosen = {"length_penalty": args.length_penalty, "quantize": args.quantize}
    translator.set_decoding(**{key: value for key, value in chosen.items() if value is not None})
    return translator


def _open_translator(args: argparse.Namespace, run_dir: Path, checkpoint: Path | None):
    """`translate`'s numpy engine where `cli_parser.numpy_engine_refusal` and the run allow it, which
    imports no torch (README: "Translating"); else (and for `evaluate`) the torch `Translator`."""
    refusal = numpy_engine_refusal(args) if args.command == "translate" else args.command
    if refusal is None:
        from transformer_mt.numpy_translator import EngineUnavailable, NumpyTranslator
        try:
            return NumpyTranslator.from_run(run_dir, checkpoint)
        except EngineUnavailable as err:
            refusal = str(err)
    if args.command == "translate" and args.engine == "numpy":
        raise UsageError(f"--engine numpy: {refusal}; leave out --engine to translate with torch")
    from transformer_mt.translator import Translator

    return Translator.from_run(run_dir, checkpoint=checkpoint, device=args.device)


def _shown(path: Path) -> str:
    """`path` as messages show it: relative to the working folder when it lies under it (as the
    paths users type), else absolute; the same file reads the same however it was reached."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


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


class _BarAwareHandler(logging.StreamHandler):
    """Writes each record through `tqdm.write`: it clears the live bars, writes the record on lines of
    its own and draws the bars again (a StreamHandler writes on the bar's line, which the bar's next
    refresh draws over). With no bar live it writes as a StreamHandler."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # as StreamHandler: a failing handler reports, never raises into the caller
            self.handleError(record)


def _setup_logging(level: int, log_path: Path | None = None) -> logging.Handler | None:
    """Log to stderr at `level`, and everything at INFO and above to `log_path` if given."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = _BarAwareHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root.handlers = [console]
    for noisy in ("datasets", "urllib3", "filelock", "fsspec", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if log_path is None:
        return None
    file_handler = OptionalFileHandler(log_path, encoding="utf-8")  # a full disk stops the log, not the run
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    return file_handler
