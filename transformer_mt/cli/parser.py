"""The command line's grammar: `tmt`'s subcommands, their options, help texts and examples.
It only describes; `cli` parses argv with it, runs the command and prints."""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
import textwrap
from pathlib import Path

from transformer_mt import __version__
from transformer_mt.config.schema import BLEU_TOKENIZERS

STDIO = "-"  # `tmt translate --input -` / `--output -`: stdin / stdout, as in most command-line tools

MAIN_EXAMPLES = """a first run (CPU, a few minutes):
  tmt data --config configs/demo.yaml      # first the data: pairs, lengths
  tmt train --config configs/demo.yaml     # train on the bundled en-it corpus
  tensorboard --logdir runs                # curves, translations, attention
  tmt translate "Where is the station?"    # translate with the newest run
  tmt evaluate --run runs/demo --beam 5    # BLEU, chrF, chrF++, TER on the test
  tmt runs                                 # every run: status, steps, BLEU

`tmt COMMAND --help` shows each command's options and examples.
"""

TRAIN_EXAMPLES = """examples:
  tmt train --config configs/demo.yaml
  tmt train --config configs/demo.yaml --set train.max_steps=2000 \\
      --set model.dropout=0.2
  tmt train --config configs/demo.yaml --resume   # from the newest checkpoint
  tensorboard --logdir runs                       # watch the curves
"""

DATA_EXAMPLES = """examples:
  # the report tmt train logs before its first step
  tmt data --config configs/demo.yaml
  tmt data --config configs/demo.yaml --set tokenizer.vocab_size=2000 \\
      --set model.max_len=32
  # steps per epoch at another token budget
  tmt data --config configs/demo.yaml --set train.batch_tokens=4096

Nothing is written: tokenizers are trained in a temporary folder, or reused from the run
directory (--run-dir, default runs/<name>) when its data and tokenizer settings are the same.
"""

TRANSLATE_EXAMPLES = """examples:
  tmt translate "Where is the station?"           # the newest run under ./runs
  tmt translate --run runs/demo "Good morning." "Thank you!"
  tmt translate --run runs/demo --beam 5 --input test.en --output test.it
  tmt translate --checkpoint runs/demo/checkpoints/step_00001200.pt \\
      < input.en > output.it
  tmt translate --run runs/demo --show-attention attention.png \\
      "Where is the station?"
  # at a terminal: type a sentence, get its translation
  tmt translate --run runs/demo
  tmt translate --run runs/demo --beam 5 --n-best 3 --scores \\
      "Where is the station?"
  tmt translate --run runs/demo --beam 5 --n-best 5 --format jsonl \\
      --input transformer_mt/corpora/demo_en_it/test.en > test.nbest.jsonl
  tmt translate --run runs/demo --sample --top-p 0.9 --seed 1 --n-best 2 \\
      "Where is the station?"
"""

EVALUATE_EXAMPLES = """examples:
  tmt evaluate --run runs/demo                    # the run's test split, greedy
  tmt evaluate --run runs/demo --split valid --beam 5
  # pre-tokenized text
  tmt evaluate --run runs/m30k --src test.en --ref test.de --tokenize none
  # two references of each sentence
  tmt evaluate --run runs/demo --src test.en --ref test.it other.it
"""

SCORE_EXAMPLES = """examples:
  # one line each: log-prob<TAB>per token
  tmt score --run runs/demo --source test.en --target test.it
  # source<TAB>target lines on stdin
  paste test.en test.it | tmt score --run runs/demo
  # every token's log-prob
  tmt score --run runs/demo --source test.en --target test.it --format jsonl
"""

COMPARE_EXAMPLES = """examples:
  # the demo against another seed of it (the first is the baseline)
  tmt train --config configs/demo.yaml --run-dir runs/demo-seed2 --set seed=2
  tmt compare runs/demo runs/demo-seed2
  tmt compare base.it new.it --ref test.it        # hypothesis files
  # tables to paste into a report
  tmt compare runs/demo runs/demo-seed2 --format markdown
"""

EXPORT_EXAMPLES = """examples:
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2-int8 \\
      --quantization int8
  # for transformers' from_pretrained
  tmt export --format hf --run runs/demo --output demo-hf
"""

RUNS_EXAMPLES = """examples:
  tmt runs                          # the runs under ./runs, newest first
  tmt runs --dir /data/experiments
  cat runs/demo/summary.json        # one run's provenance, metrics, speed
"""

SERVE_EXAMPLES = """examples:
  tmt serve --run runs/demo              # a web page at http://127.0.0.1:8000/
  curl -s localhost:8000/translate -d '{"sentences": ["Where is the station?"]}'
  curl -s localhost:8000/translate \\
      -d '{"sentences": ["Good morning."], "beam_size": 5, "n_best": 3}'
  tmt serve --run runs/demo --host 0.0.0.0 --port 8080 --max-wait-ms 20 \\
      --batch-tokens 8192

Requests that arrive together are translated in one batch; SIGTERM or Ctrl-C answers the requests
already received, then stops (exit 0). The guide "Serving" describes the API.
"""

AVERAGE_EXAMPLES = """examples:
  tmt average --run runs/m30k            # the last 5 step checkpoints
  tmt average --run runs/demo --last 2   # the demo keeps 2 (train.keep_last)
  tmt evaluate --beam 5 \\
      --checkpoint runs/demo/checkpoints/average_steps_00000900-00001200.pt
"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "invalid choice" error also says which choice was probably meant
    (`tmt trian` -> did you mean 'train'?), as config keys do, and which answers `--set KEY VALUE`
    (a space for the =) with the word that fixes it."""

    def parse_args(self, args=None, namespace=None):
        words = list(sys.argv[1:] if args is None else args)
        for option, key, value in zip(words, words[1:], words[2:]):
            if option == "--set" and "=" not in key and not value.startswith("-"):
                self.exit(2, f"tmt: error: --set {key} {value}: write KEY=VALUE as one word: --set {key}={value}\n")
        return super().parse_args(words, namespace)

    def error(self, message: str):
        """One line, `tmt: error: tmt COMMAND: what is wrong`, and exit 2 (argparse's usage lines would come first)."""
        match = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            close = difflib.get_close_matches(match.group(1), choices, n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        where = f"{self.prog}: " if " " in self.prog else ""  # `tmt export: `; nothing for tmt itself
        self.exit(2, f"tmt: error: {where}{message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, wrapped to the terminal without cutting a word (`--show-attention`, a path):
    prose paragraphs of descriptions and examples are wrapped, their indented lines (commands) kept."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines, prose = [], []
        for line in [*text.splitlines(), ""]:
            if line and not line[0].isspace():  # a line of a prose paragraph
                prose.append(line)
                continue
            if prose:
                lines += textwrap.wrap(" ".join(" ".join(prose).split()), width, initial_indent=indent,
                                       subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
                prose = []
            lines.append(indent + line if line else line)
        return "\n".join(lines[:-1])


def _add_command(commands, name: str, summary: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand whose `--help` opens with `summary` (as `tmt --help` lists it) and ends with `epilog`."""
    return commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                               epilog=epilog, formatter_class=_Formatter)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tmt", description="Train Transformer translation models and translate with them.",
                     epilog=MAIN_EXAMPLES, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"tmt {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = _add_command(commands, "train", "train a model from a YAML config", TRAIN_EXAMPLES)
    train.add_argument("--config", required=True, type=Path, help="YAML config file")
    train.add_argument("--run-dir", type=Path, help="where the run is written (default: runs/<name from config>)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.lr=3e-4 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    train.add_argument("--overwrite", action="store_true", help="delete an existing run in --run-dir and start over")
    train.add_argument("--quiet", "--no-progress", dest="no_progress", action="store_true",
                       help="no progress bars (the log lines stay)")

    data = _add_command(commands, "data", "report on the data before training: pairs, filters, lengths, "
                                             "unknown tokens, steps per epoch", DATA_EXAMPLES)
    data.add_argument("--config", required=True, type=Path, help="YAML config file")
    data.add_argument("--run-dir", type=Path, help="a run whose tokenizers and data split to reuse, read only "
                                                   "(default: runs/<name from config>, if it exists)")
    data.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set model.max_len=64 (repeatable)")
    data.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bars")

    translate = _add_command(commands, "translate", "translate sentences with a trained run", TRANSLATE_EXAMPLES)
    translate.add_argument("text", nargs="*", help="sentences to translate (default: one per line from stdin)")
    _add_model_arguments(translate)
    translate.add_argument("--input", type=_path_or_dash, help="translate this file, one sentence per line (- = stdin)")
    translate.add_argument("--output", type=_path_or_dash,
                           help="write translations here instead of stdout (- = stdout)")
    translate.add_argument("--show-attention", type=Path, metavar="FILE.png",
                           help="draw the cross-attention of the (single) sentence's translation to FILE.png "
                                "(or .jpg, .pdf, .svg, ...: the format the suffix names)")
    translate.add_argument("--attention-layer", type=int, metavar="N",
                           help="decoder layer to draw for --show-attention: 0 is the first, -1 (default) the last")
    translate.add_argument("--interactive", action="store_true",
                           help="translate each line as it is typed (the default when stdin is a terminal and "
                                "no sentence, --input or --output is given)")
    lists = translate.add_argument_group("n-best lists, scores and sampling (the Translating guide)")
    lists.add_argument("--n-best", type=_positive_int, default=1, metavar="K",
                       help="the K best translations of each sentence (K at most the beam size), best first; "
                            "text output: one line each, '<sentence number from 0><TAB>[<score><TAB>]<translation>'")
    lists.add_argument("--scores", action="store_true",
                       help="put each translation's score before it and a TAB: its log-probability over the GNMT "
                            "length penalty ((5 + length) / 6)^alpha, as beam search ranks them")
    lists.add_argument("--format", choices=["text", "jsonl"], default="text",
                       help="text (default), or jsonl: one JSON object per sentence with source, hypotheses, "
                            "scores and tokens (BPE pieces)")
    lists.add_argument("--sample", action="store_true",
                       help="draw translations from the model instead of searching (back-translation); "
                            "--n-best K draws K per sentence")
    lists.add_argument("--temperature", type=_positive_float, metavar="T",
                       help="with --sample: divide the logits by T (default 1; below 1 sharper, above flatter)")
    lists.add_argument("--top-k", type=_non_negative_int, metavar="K",
                       help="with --sample: draw from the K most probable tokens only (default 0: all)")
    lists.add_argument("--top-p", type=_probability, metavar="P",
                       help="with --sample: draw from the most probable tokens that together reach probability P "
                            "(nucleus sampling; default 1: all)")
    lists.add_argument("--seed", type=_seed, metavar="N",
                       help="with --sample: the random seed (default 0); the same input (lines and their order), "
                            "options and seed give the same samples on the same device")

    evaluate = _add_command(commands, "evaluate", "translate a test set and score it with sacreBLEU: BLEU, chrF, "
                                                  "chrF++ and TER with confidence intervals", EVALUATE_EXAMPLES)
    _add_model_arguments(evaluate)
    evaluate.add_argument("--split", choices=["valid", "test"], default="test",
                          help="which split of the run's own data to score (default: test)")
    evaluate.add_argument("--src", type=Path, help="source file to translate instead of a split (needs --ref)")
    evaluate.add_argument("--ref", type=Path, nargs="+", metavar="REF",
                          help="reference translations of --src, line by line; several files: several references "
                               "of each sentence (sacreBLEU's multi-reference scores)")
    evaluate.add_argument("--bootstrap", type=_non_negative_int, default=1000, metavar="N",
                          help="bootstrap resamples for each score's 95%% confidence interval, sacreBLEU's "
                               "(seed: SACREBLEU_SEED, default 12345); 0 = no interval (default 1000)")
    evaluate.add_argument("--comet", metavar="MODEL",
                          help="also score with COMET: a Hub model name (Unbabel/wmt22-comet-da) or a downloaded "
                               "model folder; needs the comet extra (pip install 'transformer-mt[comet]')")
    evaluate.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                          help="leave out the diagnostics printed after the scores: copies of the source, untranslated "
                               "output, another script, n-gram loops, length outliers, numbers, URLs and end "
                               "punctuation that differ from the source, chrF by source length")
    evaluate.add_argument("--tokenize", choices=BLEU_TOKENIZERS, metavar="TOKENIZER",
                          help=f"sacreBLEU tokenizer for BLEU: {', '.join(BLEU_TOKENIZERS)} (default: the run's "
                               "train.bleu_tokenize, normally 13a; none for pre-tokenized text)")
    evaluate.add_argument("--output", type=_path_or_dash,
                          help="where to write the hypotheses (default: in <run>/evaluation/, named "
                               "<name>.<checkpoint>.beam<K>[.lp<ALPHA>][.int8].txt)")

    scoring = _add_command(commands, "score", "the model's log-probability of given translations (source, target "
                                              "pairs)", SCORE_EXAMPLES)
    source = scoring.add_mutually_exclusive_group()
    source.add_argument("--run", type=Path, help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint file inside a run's checkpoints/ folder")
    scoring.add_argument("--source", type=Path, help="source sentences, one per line (needs --target; default: "
                                                     "source<TAB>target lines on stdin)")
    scoring.add_argument("--target", type=Path, help="the translations to score, line by line with --source")
    scoring.add_argument("--format", choices=["text", "jsonl"], default="text",
                         help="text (default): '<log-probability><TAB><per token>' a line, the sum over the "
                              "target's tokens and EOS, then divided by their number; jsonl: an object a line "
                              "with source, target, log_prob, per_token, tokens and token_log_probs")
    scoring.add_argument("--output", type=_path_or_dash, help="write the scores here instead of stdout (- = stdout)")
    scoring.add_argument("--quantize", choices=["none", "int8"],
                         help="int8: score with CTranslate2's int8 weights on a CPU (default: the run's "
                              "decode.quantize, none)")
    scoring.add_argument("--engine", choices=["auto", "torch", "ctranslate2"],
                         help="engine (default: the run's decode.engine, auto: CTranslate2's score_batch on a CPU, "
                              "torch elsewhere); both give the same log-probabilities up to float rounding")
    scoring.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                         help="where to score (default auto: CUDA, else MPS, else the CPU)")
    scoring.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")
    scoring.set_defaults(beam=None, length_penalty=None)  # what the shared run loader reads

    compare = _add_command(commands, "compare", "compare runs or hypothesis files on one test set: intervals, "
                                                "significance, seed groups, config differences, sentences",
                           COMPARE_EXAMPLES)
    compare.add_argument("systems", nargs="+", type=Path, metavar="RUN_OR_FILE",
                         help="run directories (their final test: evaluation/test_scores.json and its hypotheses) "
                              "or hypothesis files, one line per test sentence; the first is the baseline")
    compare.add_argument("--ref", type=Path, nargs="+", metavar="REF",
                         help="reference file(s) of the test set, line by line (default: the runs' own test split; "
                              "needed for hypothesis files alone)")
    compare.add_argument("--format", choices=["text", "markdown", "json"], default="text",
                         help="text tables (default), markdown tables, or JSON with every figure")
    compare.add_argument("--tokenize", choices=BLEU_TOKENIZERS, metavar="TOKENIZER",
                         help=f"sacreBLEU tokenizer for BLEU: {', '.join(BLEU_TOKENIZERS)} (default: the first "
                              "run's train.bleu_tokenize, else 13a)")
    compare.add_argument("--bootstrap", type=_positive_int, default=1000, metavar="N",
                         help="paired bootstrap resamples, which also give the 95%% intervals (default 1000)")
    compare.add_argument("--trials", type=_positive_int, default=10000, metavar="N",
                         help="approximate randomisation trials (default 10000)")
    compare.add_argument("--comet", metavar="MODEL",
                         help="add each system's COMET score (no test of its difference): a Hub model name or a "
                              "downloaded model folder; needs the comet extra (pip install 'transformer-mt[comet]')")
    compare.add_argument("--src", type=Path, help="the test set's sources, for --comet with hypothesis files")
    compare.add_argument("--examples", type=_non_negative_int, default=3, metavar="K",
                         help="sentences shown where each system gains most over the first by sentence chrF, and "
                              "where it loses most (default 3)")

    export = _add_command(commands, "export", "export a trained run to another inference engine", EXPORT_EXAMPLES)
    export.add_argument("--format", choices=["ctranslate2", "hf"], default="ctranslate2",
                        help="the engine to export to: ctranslate2 (a CTranslate2 model directory, the default) "
                             "or hf (a Hugging Face transformers model folder)")
    export.add_argument("--run", type=Path, required=True, help="run directory")
    export.add_argument("--output", type=Path, required=True, help="new model directory to write")
    export.add_argument("--checkpoint", type=Path, help="default: best.pt, else the newest step checkpoint")
    export.add_argument("--quantization", help="CTranslate2 weight type: int8, int8_float16, float16, ... "
                                               "(default: float32; --format ctranslate2 only)")

    runs = _add_command(commands, "runs", "list training runs: status, steps, best BLEU, last update", RUNS_EXAMPLES)
    runs.add_argument("--dir", type=Path,
                      help="folder holding run directories, also grouped one folder deeper (runs/<group>/<name>), "
                           "or one run directory (default: runs)")

    average = _add_command(commands, "average", "average the weights of a run's last step checkpoints", AVERAGE_EXAMPLES)
    average.add_argument("--run", type=Path, required=True, help="run directory")
    average.add_argument("--last", type=_positive_int, default=5, metavar="N",
                         help="how many of the newest step checkpoints to average (default 5)")
    average.add_argument("--output", type=Path,
                         help="default: <run>/checkpoints/average_steps_<first>-<last>.pt (keep it in "
                              "<run>/checkpoints/ so that --checkpoint finds the run's tokenizers)")
    serve = _add_command(commands, "serve", "serve a run's translations over HTTP, with a web page to try them",
                         SERVE_EXAMPLES)
    _add_model_arguments(serve, progress=False)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every network)")
    serve.add_argument("--port", type=_port, default=8000, help="the TCP port (default 8000; 0: any free port, "
                                                                "which the line tmt prints names)")
    serve.add_argument("--max-wait-ms", type=_non_negative_float, default=0.0, metavar="MS",
                       help="how long an idle server lets a request wait for others to share its batch (default 0: "
                            "none); a busy server batches what queued meanwhile in any case")
    serve.add_argument("--batch-tokens", type=_positive_int, metavar="N",
                       help="source tokens that send a batch at once when reached (default: the run's "
                            "decode.batch_tokens); a larger request goes alone")
    serve.add_argument("--max-sentences", type=_positive_int, default=64, metavar="N",
                       help="the most sentences one request may hold (default 64)")
    serve.add_argument("--max-beam", type=_positive_int, default=16, metavar="K",
                       help="the largest beam_size a request may ask for (default 16)")
    serve.add_argument("--max-body-bytes", type=_positive_int, metavar="N",
                       help="the largest request body, refused (413) before it is read (default: what "
                            "--max-sentences sentences of the longest the model translates take as JSON)")
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser, progress: bool = True) -> None:
    """--run / --checkpoint, --beam, --length-penalty, --quantize, --engine and --device, shared by translate,
    evaluate and serve (with --quiet where a progress bar is drawn)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run", type=Path, help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint file inside a run's checkpoints/ folder")
    parser.add_argument("--beam", type=_positive_int, metavar="K",
                        help="beam size (default: the run's decode.beam_size; 1 = greedy)")
    parser.add_argument("--length-penalty", type=_non_negative_float, metavar="ALPHA",
                        help="beam search's length penalty α (default: the run's decode.length_penalty; "
                             "0 = none, higher favours longer translations)")
    parser.add_argument("--quantize", choices=["none", "int8"],
                        help="int8: decode with CTranslate2's int8 weights on a CPU, faster, translations close to "
                             "fp32 but not identical (default: the run's decode.quantize, none)")
    parser.add_argument("--engine", choices=["auto", "torch", "ctranslate2"],
                        help="decoding engine (default: the run's decode.engine, auto): auto is CTranslate2 on a "
                             "CPU (the run converted once, cached in <run>/ctranslate2/; greedy output identical "
                             "to torch's), torch on a GPU; --show-attention always draws from torch")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="where to translate (default auto: CUDA, else MPS, else the CPU; another GPU: "
                             "CUDA_VISIBLE_DEVICES=N)")
    if progress:
        parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")


def _number(convert: type, accept, requirement: str):
    """An argparse type: `convert` (int or float) the text, then refuse a value `accept` rejects
    with "must be `requirement`". Comparisons are False for nan, so nan is refused too."""
    what = "a whole number" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "at least 1")
_non_negative_int = _number(int, lambda v: v >= 0, "at least 0")
_positive_float = _number(float, lambda v: 0 < v < math.inf, "a finite number above 0")
_probability = _number(float, lambda v: 0 < v <= 1, "above 0 and at most 1")
_non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a finite number of at least 0")
_port = _number(int, lambda v: 0 <= v <= 65535, "a port number from 0 to 65535")
_seed = _number(int, lambda v: -2 ** 63 <= v < 2 ** 63, "a whole number that fits in 64 bits (torch's seeds)")


def _path_or_dash(text: str) -> Path | str:
    """A path, or `STDIO` for exactly "-" (so that `./-` still names a file called -)."""
    return STDIO if text == STDIO else Path(text)
