"""`NumpyTranslator`: `Translator`'s `translate` without torch, for `tmt translate "a sentence"` on a CPU.

`import torch` alone takes longer than translating a few sentences with a small model; this
engine reads the checkpoint with `checkpoint_reader` and decodes with `numpy_decoder`, and gives
`Translator.translate`'s translations (tests/test_numpy_translation.py). `from_run` raises
`EngineUnavailable` when it cannot give them (a checkpoint or a model option it does not read),
and the caller translates with `Translator` instead; errors of the run itself (no checkpoint,
tokenizers of another run) are the same `CheckpointError`s as `Translator.from_run`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from transformer_mt.checkpoint_reader import (UnsupportedCheckpoint, check_tokenizers, check_vocabulary,
                                              read_translation_state)
from transformer_mt.config import Config
from transformer_mt.config_loading import config_from_dict
from transformer_mt.errors import ConfigError
from transformer_mt.numpy_decoder import NumpyTransformer, beam_search, greedy_search, unsupported_reason
from transformer_mt.run_files import find_checkpoint
from transformer_mt.tokenization import BOS_ID, EOS_ID, TokenizerPair

logger = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The numpy engine cannot translate as torch would with this run; the message says why."""


class NumpyTranslator:
    """A trained model with its tokenizers, translating raw sentences in numpy on the CPU."""

    def __init__(self, model: NumpyTransformer, tokenizers: TokenizerPair, cfg: Config, run_dir: Path,
                 checkpoint: Path):
        self.model = model
        self.tokenizers = tokenizers
        self.cfg = cfg
        self.run_dir = run_dir
        self.checkpoint = checkpoint

    @classmethod
    def from_run(cls, run_dir: Path, checkpoint: Path | None = None) -> NumpyTranslator:
        """Load a run directory as `Translator.from_run` does: `best.pt` (else the newest step
        checkpoint) or `checkpoint`; its EMA weights when it has them."""
        if checkpoint is None:
            checkpoint = find_checkpoint(run_dir)
        try:
            state = read_translation_state(checkpoint)
            cfg = config_from_dict(state.config)
        except (UnsupportedCheckpoint, ConfigError) as err:  # torch's loader reads it, or says what is wrong
            raise EngineUnavailable(f"{checkpoint}: {err}") from None
        if (reason := unsupported_reason(cfg)) is not None:
            raise EngineUnavailable(f"the run's {reason} is not implemented in numpy")
        tokenizers = TokenizerPair.load(run_dir)
        check_tokenizers({"tokenizers": state.tokenizers}, tokenizers.fingerprint(), checkpoint, run_dir)
        check_vocabulary(state.model_args, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), run_dir)
        try:
            model = NumpyTransformer(state.weights, cfg.model, pad_id=state.model_args["pad_id"], bos_id=BOS_ID)
        except ValueError as err:
            raise EngineUnavailable(str(err)) from None
        logger.info("loaded %s (step %d%s) in numpy on the CPU", checkpoint, state.step,
                    ", EMA weights" if state.which == "ema" else "")
        return cls(model, tokenizers, cfg, run_dir, checkpoint)

    def set_decoding(self, **settings) -> None:
        """Decode with other `decode.*` settings than the run's, e.g. `length_penalty=1.0` (the caller
        keeps `quantize` at none: `cli_parser.numpy_engine_refusal`)."""
        self.cfg = dataclasses.replace(self.cfg, decode=dataclasses.replace(self.cfg.decode, **settings))

    def translate(self, lines: list[str], beam_size: int | None = None, progress: bool = False) -> list[str]:
        """`Translator.translate`: each line's translation (beam size `beam_size`, else the run's
        `decode.beam_size`); an empty line gives an empty line; a line longer than the model allows
        is truncated with a warning. `progress` is accepted and ignored (a handful of sentences)."""
        beam_size = self.cfg.decode.beam_size if beam_size is None else beam_size
        texts = [line.strip() for line in lines]
        src_ids = self.tokenizers.encode_src(texts)
        max_len = self.cfg.model.max_len
        too_long = sum(len(ids) >= max_len for ids in src_ids)
        if too_long:
            logger.warning("%d input(s) longer than model.max_len=%d tokens were truncated", too_long, max_len)
        hyp_ids = []
        for text, ids in zip(texts, src_ids):
            source = ids[: max_len - 1] + [EOS_ID]  # as evaluation.translate_ids cuts it
            if not text:
                hyp_ids.append([])
            elif beam_size == 1:
                hyp_ids.append(greedy_search(self.model, source, self.cfg.decode, bos_id=BOS_ID, eos_id=EOS_ID))
            else:
                hyp_ids.append(beam_search(self.model, source, self.cfg.decode, beam_size, bos_id=BOS_ID,
                                           eos_id=EOS_ID))
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        return [hyp if text else "" for text, hyp in zip(texts, hypotheses)]
