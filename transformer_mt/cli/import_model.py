"""`tmt import`: a pretrained Marian (OPUS-MT) model as a tmt run."""

from __future__ import annotations

import argparse
import logging
import sys

from transformer_mt.cli.arguments import add_command, file_path
from transformer_mt.cli.log_setup import setup_logging

IMPORT_EXAMPLES = """examples:
  tmt import Helsinki-NLP/opus-mt-en-it --run-dir runs/opus-en-it
  tmt import ./opus-mt-en-it --run-dir runs/opus-en-it   # a saved folder
  tmt translate --run runs/opus-en-it "Where is the station?"
  # fine-tune it: train.init_from: runs/opus-en-it in a training config
"""


def add_parser(commands) -> None:
    """`tmt import`: its options, help and examples."""
    parser = add_command(commands, "import", "make a run of a pretrained OPUS-MT (Marian) model", IMPORT_EXAMPLES)
    parser.add_argument("model", metavar="MODEL",
                        help="a folder written by transformers' save_pretrained (the model and its "
                             "MarianTokenizer files), or a Hugging Face Hub id, downloaded when online")
    parser.add_argument("--run-dir", type=file_path, required=True, help="the new run directory to write")


def run_import(args: argparse.Namespace) -> None:
    setup_logging(logging.INFO)
    from transformer_mt.pretrained.importing import import_marian

    done = import_marian(args.model, args.run_dir)
    m = done.cfg.model
    print(f"imported {args.model} into {args.run_dir}: Marian, {m.n_encoder_layers}+{m.n_decoder_layers} layers, "
          f"d_model {m.d_model}, {done.cfg.tokenizer.vocab_size:,} tokens, {done.parameters:,} parameters, "
          f"{done.cfg.data.src_lang} -> {done.cfg.data.tgt_lang}", file=sys.stderr)
    print(f"translate with: tmt translate --run {args.run_dir} \"...\"", file=sys.stderr)
