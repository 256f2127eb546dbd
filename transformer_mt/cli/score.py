"""`tmt score`: a run's log-probability of given (source, target) pairs, from two aligned files or
tab-separated stdin, per sentence or per token."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from transformer_mt.cli.arguments import (STDIO, add_alignment_arguments, add_command, add_target_lang,
                                          check_alignment_arguments, file_path, path_or_dash)
from transformer_mt.cli.common import check_not_kept, check_output, load_translator, run_dir_of
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import DataError, UsageError
from transformer_mt.core.files import write_lines
from transformer_mt.decode.alignment import pharaoh

SCORE_EXAMPLES = """examples:
  # one line each: log-prob<TAB>per token
  tmt score --run runs/demo --source test.en --target test.it
  # source<TAB>target lines on stdin
  paste test.en test.it | tmt score --run runs/demo
  # every token's log-prob
  tmt score --run runs/demo --source test.en --target test.it --format jsonl
  # and each pair's word alignment after a TAB
  tmt score --run runs/demo --source test.en --target test.it --alignments
"""


def add_parser(commands) -> None:
    """`tmt score`: its options, help and examples."""
    scoring = add_command(commands, "score", "the model's log-probability of given translations (source, target "
                                              "pairs)", SCORE_EXAMPLES)
    source = scoring.add_mutually_exclusive_group()
    source.add_argument("--run", type=file_path,
                        help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=file_path, help="a checkpoint file inside a run's checkpoints/ folder")
    scoring.add_argument("--source", type=file_path, help="source sentences, one per line (needs --target; default: "
                                                     "source<TAB>target lines on stdin)")
    scoring.add_argument("--target", type=file_path, help="the translations to score, line by line with --source")
    scoring.add_argument("--format", choices=["text", "jsonl"], default="text",
                         help="text (default): '<log-probability><TAB><per token>' a line, the sum over the "
                              "target's tokens and EOS, then divided by their number; jsonl: an object a line "
                              "with source, target, log_prob, per_token, tokens and token_log_probs")
    scoring.add_argument("--output", type=path_or_dash, help="write the scores here instead of stdout (- = stdout)")
    scoring.add_argument("--quantize", choices=["none", "int8"],
                         help="int8: score with CTranslate2's int8 weights on a CPU (default: the run's "
                              "decode.quantize, none)")
    scoring.add_argument("--engine", choices=["auto", "torch", "ctranslate2"],
                         help="engine (default: the run's decode.engine, auto: CTranslate2's score_batch on a CPU, "
                              "torch elsewhere); both give the same log-probabilities up to float rounding")
    scoring.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                         help="where to score (default auto: CUDA, else MPS, else the CPU)")
    add_target_lang(scoring)
    scoring.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")
    add_alignment_arguments(scoring)
    scoring.set_defaults(beam=None, length_penalty=None)  # what the shared run loader reads


def run_score(args: argparse.Namespace) -> None:
    setup_logging(logging.WARNING)
    if bool(args.source) != bool(args.target):
        raise UsageError("--source and --target go together (or give source<TAB>target lines on stdin)")
    check_alignment_arguments(args)
    if args.output == STDIO:
        args.output = None
    check_output(args.output, inputs={"--source": args.source, "--target": args.target})
    sources, targets = _read_pairs(args)
    check_not_kept(args.output, "--output", run_dir_of(args))  # before loading, which may write into the run
    translator = load_translator(args)
    scored = translator.score(sources, targets, progress=bool(args.source) and not args.quiet)
    alignments = [pharaoh(links) for links in translator.align(sources, targets, args.alignment_layer)] \
        if args.alignments else None
    if args.format == "jsonl":
        lines = [json.dumps({"source": src, "target": tgt, "log_prob": round(pair.log_prob, 4),
                             "per_token": round(pair.per_token, 4), "tokens": pair.tokens,
                             "token_log_probs": [round(p, 4) for p in pair.token_log_probs],
                             **({"alignment": alignments[i]} if alignments is not None else {})}, ensure_ascii=False)
                 for i, (src, tgt, pair) in enumerate(zip(sources, targets, scored))]
    else:
        lines = [f"{pair.log_prob:.4f}\t{pair.per_token:.4f}" + (f"\t{alignments[i]}" if alignments is not None else "")
                 for i, pair in enumerate(scored)]
    if args.output:
        write_lines(args.output, lines)
    else:
        for line in lines:
            print(line)
        sys.stdout.flush()


def _read_pairs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The (source, target) pairs to score: line i of --source and --target, else `source<TAB>target`
    lines on stdin; an empty side, a missing tab or no pairs at all is refused, naming the line."""
    from transformer_mt.data.sources import read_aligned_files, read_stream_lines

    if args.source:
        pairs = read_aligned_files(args.source, args.target)
        names = (str(args.source), str(args.target))
    else:
        if sys.stdin.isatty():
            raise UsageError("nothing to score: give --source FILE --target FILE, or source<TAB>target lines on stdin")
        pairs = []
        for number, line in enumerate(read_stream_lines(sys.stdin.buffer, "stdin"), start=1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(f"stdin line {number}: expected source<TAB>target (one tab), found {len(fields) - 1}")
            pairs.append((fields[0].strip(), fields[1].strip()))
        names = ("stdin", "stdin")
    if not pairs:
        raise UsageError(f"nothing to score: {names[0]} has no lines")
    for number, (src, tgt) in enumerate(pairs, start=1):
        for side, text, name in (("source", src, names[0]), ("target", tgt, names[1])):
            if not text:
                raise DataError(f"{name} line {number}: the {side} is empty; score needs a sentence on both sides")
    return [src for src, _ in pairs], [tgt for _, tgt in pairs]
