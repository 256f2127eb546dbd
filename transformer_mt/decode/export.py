"""Export a trained run to other inference engines: CTranslate2 (`tmt export --format ctranslate2`).

The exported model is the same network with the same weights (`ct2_conversion`): CTranslate2's
greedy search gives tmt's greedy output token for token (tests/decode/test_export.py checks it).
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformer_mt.core.errors import TmtError, UsageError
from transformer_mt.core.files import check_parent_dir, make_parent_dir
from transformer_mt.decode.ct2_conversion import ctranslate2_spec, save_model_dir
from transformer_mt.runs.checkpoint import load_run
from transformer_mt.runs.run_dir import lock_if_inside

logger = logging.getLogger(__name__)


def export_ctranslate2(run_dir: Path, output_dir: Path, checkpoint: Path | None = None,
                       quantization: str | None = None) -> None:
    """Write a CTranslate2 model directory for a run: `model.bin`, `config.json`, the vocabularies
    (`shared_vocabulary.json`, or `source_`/`target_vocabulary.json`) and tmt's tokenizer files.

    Weights come from `checkpoint` (default: the run's `best.pt`, else its newest step
    checkpoint): its EMA weights when it has them (`train.ema_decay`), as `tmt translate` uses.
    `quantization` is CTranslate2's weight type (int8, int8_float16, float16, ...); None keeps
    fp32. Use the result with token strings from tmt's tokenizer (the files are
    copied in; load one with `Tokenizer.from_file` and set `tokenizer.encode_special_tokens =
    True`, which the file cannot hold, so a literal `</s>` in the text stays text, as in tmt):
    `ctranslate2.Translator(dir).translate_batch([tokenizer.encode(text, add_special_tokens=False)
    .tokens], beam_size=1, min_decoding_length=0, max_input_length=max_len)` gives tmt's
    greedy output (CTranslate2's default `min_decoding_length=1` forbids an empty translation;
    `max_input_length` = the run's `model.max_len` cuts long sources as tmt does, to max_len - 1
    tokens and EOS; tmt's length cap a·S + b maps to
    `max_decoding_length`).
    """
    try:
        import ctranslate2  # noqa: F401  (a dependency, but a platform may lack its wheel)
        from ctranslate2.specs import model_spec
    except ImportError:
        raise TmtError("exporting to CTranslate2 needs the ctranslate2 package: pip install ctranslate2") from None
    if quantization is not None and quantization not in model_spec.ACCEPTED_MODEL_TYPES:
        raise UsageError(f"--quantization: {quantization!r} is not one of "
                         f"{', '.join(model_spec.ACCEPTED_MODEL_TYPES)}")
    check_parent_dir(output_dir, "--output")
    target = output_dir.resolve()  # `.` or `..` has no name to write a temp folder beside
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{output_dir} already exists and is not an empty directory; choose another --output")
    if Path.cwd().is_relative_to(target):  # replacing it would pull the folder from under the shell
        raise UsageError(f"--output {output_dir} is the current directory; choose a new directory")

    run = load_run(run_dir, checkpoint)
    spec = ctranslate2_spec(run.model, run.tokenizers, run_dir, quantization)
    with lock_if_inside(run_dir, output_dir, "tmt export"):  # never beside the run's trainer
        make_parent_dir(output_dir, "--output")
        try:
            save_model_dir(spec, target)
        except OSError as err:
            raise TmtError(f"{output_dir}: could not write the CTranslate2 model ({err.strerror or err})") from None
    logger.info("exported %s to %s (CTranslate2, %s)", run_dir, output_dir, quantization or "float32")
