"""What every command's parser is built from: the help formatter, `add_command`, the options of the
commands that translate with a run, and the converters of numbers and paths that refuse a bad value."""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

from transformer_mt.core.errors import DataError, UsageError

STDIO = "-"  # `tmt translate --input -` / `--output -`: stdin / stdout, as in most command-line tools


class Formatter(argparse.RawDescriptionHelpFormatter):
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


def add_command(commands, name: str, summary: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand whose `--help` opens with `summary` (as `tmt --help` lists it) and ends with `epilog`."""
    return commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                               epilog=epilog, formatter_class=Formatter)


def add_model_arguments(parser: argparse.ArgumentParser, progress: bool = True) -> None:
    """--run / --checkpoint, --beam, --length-penalty, --quantize, --engine, --device and --target-lang, shared
    by translate, evaluate and serve (with --quiet where a progress bar is drawn)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run", type=file_path,
                        help="run directory (default: the most recently updated run under ./runs)")
    source.add_argument("--checkpoint", type=file_path, help="a checkpoint file inside a run's checkpoints/ folder")
    parser.add_argument("--beam", type=positive_int, metavar="K",
                        help="beam size (default: the run's decode.beam_size; 1 = greedy)")
    parser.add_argument("--length-penalty", type=non_negative_float, metavar="ALPHA",
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
    add_target_lang(parser)
    if progress:
        parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")


def add_target_lang(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-lang", metavar="LANG", type=language_code,
                        help="the target language of a multilingual model (OPUS-MT's en-roa, or one trained on tagged "
                             "data.corpora): puts its tag >>LANG<< before each source; needed when the model knows "
                             "several; a line that begins with a tag of the model keeps its own (default: the run's "
                             "decode.target_lang)")


def add_glossary_arguments(parser: argparse.ArgumentParser, what: str = "each translation") -> None:
    """--glossary and --glossary-case (translate, evaluate, serve)."""
    from transformer_mt.data.glossary import GLOSSARY_CASES

    group = parser.add_argument_group("terminology (the Translating guide)")
    group.add_argument("--glossary", type=file_path, metavar="TERMS.tsv",
                       help=f"a glossary, a line per term: source term<TAB>target term (# comments and blank lines "
                            f"skipped); {what} of a sentence that holds a source term (whole words) contains its "
                            "target term, by constrained beam search (beam 2 or more, K - 1 terms a sentence for "
                            "a beam of K; the torch engine)")
    group.add_argument("--glossary-case", choices=GLOSSARY_CASES, default=GLOSSARY_CASES[0],
                       help="how --glossary's source terms match: insensitive (default: a term written in lower "
                            "case also matches at the start of a sentence) or sensitive (acronyms, names)")


def read_glossary_option(args: argparse.Namespace):
    """The --glossary file read (`data.glossary.read_glossary`), None without one: before a model loads."""
    from transformer_mt.data.glossary import read_glossary

    return None if args.glossary is None else read_glossary(args.glossary, args.glossary_case)


def check_glossary_terms(glossary, translator) -> None:
    """Refuse, naming its line, a glossary's target term that the run's target vocabulary cannot spell."""
    for term in glossary.terms if glossary is not None else ():
        if problem := translator.term_problem(term.target):
            raise DataError(f"glossary {glossary.path} line {term.line}: {problem}")


def add_alignment_arguments(parser: argparse.ArgumentParser) -> None:
    """--alignments and --alignment-layer (translate, score)."""
    group = parser.add_argument_group("word alignments (the Translating guide)")
    group.add_argument("--alignments", action="store_true",
                       help="the word alignment of each translation (tmt score: of each target) from the model's "
                            "cross-attention, as Pharaoh links '<source word>-<target word>' (0-0 1-2 ...; words "
                            "split at spaces, from 0): text output, after a TAB at the end of its line (cut -f to split off a file as fast_align "
                            "writes); jsonl, in an \"alignments\" field")
    group.add_argument("--alignment-layer", type=int, metavar="N",
                       help="with --alignments: the decoder layer whose attention aligns, 0 the first, -1 the last "
                            "(default: the second to last, or the only one)")


def check_alignment_arguments(args: argparse.Namespace) -> None:
    if args.alignment_layer is not None and not args.alignments:
        raise UsageError("--alignment-layer picks the layer --alignments reads: add --alignments")


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


positive_int = _number(int, lambda v: v >= 1, "at least 1")
non_negative_int = _number(int, lambda v: v >= 0, "at least 0")
positive_float = _number(float, lambda v: 0 < v < math.inf, "a finite number above 0")
probability = _number(float, lambda v: 0 < v <= 1, "above 0 and at most 1")
non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a finite number of at least 0")
port_number = _number(int, lambda v: 0 <= v <= 65535, "a port number from 0 to 65535")
seed_number = _number(int, lambda v: -2 ** 63 <= v < 2 ** 63, "a whole number that fits in 64 bits (torch's seeds)")


def language_code(text: str) -> str:
    """A language code for a target-language tag: `ita` (for >>ita<<), refused as the tag itself or with spaces."""
    from transformer_mt.config.schema import language_code_problem

    if problem := language_code_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


def file_path(text: str) -> Path:
    """A path that can name a file: no NUL character (the system's calls stop at one)."""
    if "\x00" in text:
        raise argparse.ArgumentTypeError("a file name cannot hold a NUL character")
    return Path(text)


def path_or_dash(text: str) -> Path | str:
    """A path, or `STDIO` for exactly "-" (so that `./-` still names a file called -)."""
    return STDIO if text == STDIO else file_path(text)
