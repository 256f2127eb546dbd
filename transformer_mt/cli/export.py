"""`tmt export`: a run's model for another inference engine."""

from __future__ import annotations

import argparse
import logging

from transformer_mt.cli.log_setup import setup_logging


def run_export(args: argparse.Namespace) -> None:
    from transformer_mt.decode.ct2_conversion import export_ctranslate2

    setup_logging(logging.INFO)
    export_ctranslate2(args.run, args.output, args.checkpoint, args.quantization)
