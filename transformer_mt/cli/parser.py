"""The command line's grammar: `tmt`, its description and examples, and its subcommands in the order
`tmt --help` lists them, each declared by its command module's `add_parser` beside its `run_*`.
It only describes; `cli` parses argv with it, runs the command and prints."""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from transformer_mt import __version__
from transformer_mt.cli import average, compare, data, export, import_model, runs, score, serve, train, translate
from transformer_mt.cli.arguments import Formatter

MAIN_EXAMPLES = """a first run (CPU, a few minutes):
  tmt data --config configs/demo.yaml      # first the data: pairs, lengths
  tmt train --config configs/demo.yaml     # train on the bundled en-it corpus
  tensorboard --logdir runs                # curves, translations, attention
  tmt translate "Where is the station?"    # translate with the newest run
  tmt evaluate --run runs/demo --beam 5    # BLEU, chrF, chrF++, TER on the test
  tmt runs                                 # every run: status, steps, BLEU

`tmt COMMAND --help` shows each command's options and examples.
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tmt", description="Train Transformer translation models and translate with them.",
                     epilog=MAIN_EXAMPLES, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"tmt {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (train.add_parser, data.add_parser, translate.add_parser, translate.add_evaluate_parser,
                score.add_parser, compare.add_parser, export.add_parser, import_model.add_parser, runs.add_parser,
                average.add_parser, serve.add_parser):  # in the order `tmt --help` lists them
        add(commands)
    return parser
