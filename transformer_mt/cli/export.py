"""`tmt export`: a run's model for another inference engine."""

from __future__ import annotations

import argparse
import logging

from transformer_mt.cli.arguments import add_command, file_path
from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import UsageError

EXPORT_EXAMPLES = """examples:
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2
  tmt export --format ctranslate2 --run runs/demo --output demo-ct2-int8 \\
      --quantization int8
  # for transformers' from_pretrained
  tmt export --format hf --run runs/demo --output demo-hf
"""


def add_parser(commands) -> None:
    """`tmt export`: its options, help and examples."""
    export = add_command(commands, "export", "export a trained run to another inference engine", EXPORT_EXAMPLES)
    export.add_argument("--format", choices=["ctranslate2", "hf"], default="ctranslate2",
                        help="the engine to export to: ctranslate2 (a CTranslate2 model directory, the default) "
                             "or hf (a Hugging Face transformers model folder)")
    export.add_argument("--run", type=file_path, required=True, help="run directory")
    export.add_argument("--output", type=file_path, required=True, help="new model directory to write")
    export.add_argument("--checkpoint", type=file_path, help="default: best.pt, else the newest step checkpoint")
    export.add_argument("--quantization", help="CTranslate2 weight type: int8, int8_float16, float16, ... "
                                               "(default: float32; --format ctranslate2 only)")


def run_export(args: argparse.Namespace) -> None:
    setup_logging(logging.INFO)
    if args.format == "hf":
        from transformer_mt.export.hf_export import export_hf

        if args.quantization is not None:
            raise UsageError("--quantization is for --format ctranslate2; --format hf writes fp32 weights")
        export_hf(args.run, args.output, args.checkpoint)
    else:
        from transformer_mt.export.ct2_conversion import export_ctranslate2

        export_ctranslate2(args.run, args.output, args.checkpoint, args.quantization)
