"""`tmt export`: a run's model for another inference engine."""

from __future__ import annotations

import argparse
import logging

from transformer_mt.cli.log_setup import setup_logging
from transformer_mt.core.errors import UsageError


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
