"""`Translator.from_run(path).translate(lines)`: translation with a trained run (greedy or beam search)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.checkpoint import check_tokenizers, check_vocabulary, load_checkpoint, translation_weights
from transformer_mt.config import Config
from transformer_mt.config_loading import config_from_dict
from transformer_mt.errors import CheckpointError, ConfigError, UsageError
from transformer_mt.decoding import Sampling
from transformer_mt.evaluation import cross_attention_labels, cross_attention_map, translate_hypotheses, translate_ids
from transformer_mt.architectures import build_model
from transformer_mt.model import Transformer
from transformer_mt.run_files import find_checkpoint, latest_run  # noqa: F401  (latest_run: callers import it here)
from transformer_mt.runtime import Precision, pick_device, pick_precision, warn_attention_fallbacks
from transformer_mt.tokenization import BOS_ID, EOS, EOS_ID, TokenizerPair

logger = logging.getLogger(__name__)


class Translator:
    """A trained model with its tokenizers, ready to translate raw sentences."""

    def __init__(self, model: Transformer, tokenizers: TokenizerPair, cfg: Config, device: torch.device,
                 precision: Precision, run_dir: Path, checkpoint: Path):
        self.model = model.eval()
        self.tokenizers = tokenizers
        self.cfg = cfg  # the run's config: decoding settings, and data for `tmt evaluate --split`
        self.device = device
        self.precision = precision
        self.run_dir = run_dir
        self.checkpoint = checkpoint  # the weights' file, which names `tmt evaluate`'s output

    @classmethod
    def from_run(cls, run_dir: Path, checkpoint: Path | None = None, device: str = "auto") -> Translator:
        """Load a run directory: `best.pt` (else the newest step checkpoint) or `checkpoint`; its
        EMA weights when it has them (`train.ema_decay`), else its trained weights."""
        if checkpoint is None:
            checkpoint = find_checkpoint(run_dir)
        state = load_checkpoint(checkpoint)
        try:
            cfg: Config = config_from_dict(state["config"])
        except ConfigError as err:
            raise CheckpointError(f"{checkpoint}: the config stored in the checkpoint is invalid ({err})") from None
        tokenizers = TokenizerPair.load(run_dir)
        check_tokenizers(state, tokenizers.fingerprint(), checkpoint, run_dir)
        args = state["model_args"]
        check_vocabulary(args, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), run_dir)
        model = build_model(cfg.model, args["src_vocab_size"], args["tgt_vocab_size"], args["pad_id"])
        weights, which = translation_weights(state)
        model.load_state_dict(weights)
        torch_device = pick_device(device)
        logger.info("loaded %s (step %d%s) on %s", checkpoint, state.get("train_state", {}).get("step", -1),
                    ", EMA weights" if which == "ema" else "", torch_device)
        warn_attention_fallbacks(torch_device, {"decode.attention_backend": cfg.decode.attention_backend})
        translator = cls(model.to(torch_device), tokenizers, cfg, torch_device, _precision_for(cfg, torch_device),
                         run_dir, checkpoint)
        translator._warn_quantize_ignored()
        return translator

    def set_decoding(self, **settings) -> None:
        """Decode with other `decode.*` settings than the run's, e.g. `length_penalty=1.0`."""
        self.cfg = dataclasses.replace(self.cfg, decode=dataclasses.replace(self.cfg.decode, **settings))
        if "quantize" in settings:
            self._warn_quantize_ignored()

    @property
    def quantized(self) -> str | None:
        """The weights' quantisation translations are made with (`decode.quantize` on a CPU), or None."""
        return self.cfg.decode.quantize if self.cfg.decode.quantize != "none" and self.device.type == "cpu" else None

    def _warn_quantize_ignored(self) -> None:
        if self.cfg.decode.quantize != "none" and self.device.type != "cpu":
            logger.warning("decode.quantize: %s applies to CPU decoding only; decoding on %s unquantised",
                           self.cfg.decode.quantize, self.device.type)

    def translate(self, lines: list[str], beam_size: int | None = None, progress: bool = False) -> list[str]:
        """Translate each line (beam size: `beam_size`, else the run's `decode.beam_size`).

        An empty line gives an empty line; a line longer than the model allows is truncated
        with a warning.
        """
        texts = [line.strip() for line in lines]
        src_ids = self._encode_src(texts)
        hyp_ids = translate_ids(self.model, src_ids, self.cfg.decode, bos_id=BOS_ID, eos_id=EOS_ID,
                                device=self.device, precision=self.precision, beam_size=beam_size,
                                quantize=self.cfg.decode.quantize, progress=progress)
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        return [hyp if text else "" for text, hyp in zip(texts, hypotheses)]

    def translate_n_best(self, lines: list[str], n_best: int = 1, beam_size: int | None = None,
                         sampling: Sampling | None = None, progress: bool = False) -> list[list[Translation]]:
        """Each line's `n_best` translations with their scores: the best of beam search, best
        first (beam 1 is greedy decoding; the first is what `translate` gives), or with
        `sampling`, samples in the order drawn. An empty line gets one empty translation, scored 0.
        """
        texts = [line.strip() for line in lines]
        hypotheses = translate_hypotheses(self.model, self._encode_src(texts), self.cfg.decode, bos_id=BOS_ID,
                                          eos_id=EOS_ID, device=self.device, precision=self.precision,
                                          beam_size=beam_size, n_best=n_best, sampling=sampling,
                                          quantize=self.cfg.decode.quantize, progress=progress)
        results = []
        for text, hyps in zip(texts, hypotheses):
            if not text:
                results.append([Translation("", 0.0, [])])
                continue
            decoded = self.tokenizers.decode_tgt([hyp.ids for hyp in hyps])
            results.append([Translation(translation, hyp.score, self.tokenizers.tgt_pieces(hyp.ids))
                            for translation, hyp in zip(decoded, hyps)])
        return results

    def attention(self, line: str, layer: int = -1, beam_size: int | None = None) -> AttentionMap:
        """Translate one line and return where decoder layer `layer` (-1: the last) looked.

        A line longer than the model allows is truncated with a warning, as in `translate`.
        """
        src_ids = self._encode_src([line.strip()])[0][: self.model.cfg.max_len - 1]  # as translate_ids cuts it
        hyp_ids = translate_ids(self.model, [src_ids], self.cfg.decode, bos_id=BOS_ID, eos_id=EOS_ID,
                                device=self.device, precision=self.precision, beam_size=beam_size,
                                quantize=self.cfg.decode.quantize)[0]
        weights = cross_attention_map(self.model, src_ids, hyp_ids, bos_id=BOS_ID, eos_id=EOS_ID,
                                      device=self.device, layer=layer)
        src_pieces, tgt_pieces = cross_attention_labels(
            self.tokenizers.src_pieces(src_ids), self.tokenizers.tgt_pieces(hyp_ids), EOS, self.model.cfg.max_len)
        return AttentionMap(weights, src_pieces, tgt_pieces, self.tokenizers.decode_tgt([hyp_ids])[0])

    def _encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids of `texts`, warning about those longer than model.max_len (decoding truncates them)."""
        src_ids = self.tokenizers.encode_src(texts)
        too_long = sum(len(ids) >= self.model.cfg.max_len for ids in src_ids)
        if too_long:
            logger.warning("%d input(s) longer than model.max_len=%d tokens were truncated",
                           too_long, self.model.cfg.max_len)
        return src_ids


@dataclass(frozen=True)
class Translation:
    """One translation of a sentence, with what rescoring needs."""

    text: str
    score: float  # log-probability (EOS included) / GNMT length penalty ((5 + length) / 6)^α
    tokens: list[str]  # the target BPE pieces the model produced, without BOS and EOS


@dataclass(frozen=True)
class AttentionMap:
    """Cross-attention of one translated sentence, ready to plot."""

    weights: torch.Tensor  # (T, S): row t is where the decoder looked while producing target piece t
    src_pieces: list[str]
    tgt_pieces: list[str]
    translation: str


def format_translations(lines: list[str], results: list[list[Translation]], *, jsonl: bool, numbered: bool,
                        scores: bool, first_number: int = 0) -> list[str]:
    """The output lines of `translate --n-best/--scores/--format` (README: "n-best lists and scores").

    jsonl: one JSON object per source line (source, hypotheses, scores, tokens). Text: one line
    per translation, TAB-separated: `[<sentence number>]` (from `first_number`, when `numbered`),
    `[<score>]` (4 decimals, with `scores`), then the translation.
    """
    if jsonl:
        return [json.dumps({"source": line, "hypotheses": [t.text for t in translations],
                            "scores": [t.score for t in translations], "tokens": [t.tokens for t in translations]},
                           ensure_ascii=False) for line, translations in zip(lines, results)]
    outputs = []
    for number, translations in enumerate(results, start=first_number):
        for translation in translations:
            fields = ([str(number)] if numbered else []) + ([f"{translation.score:.4f}"] if scores else [])
            outputs.append("\t".join(fields + [translation.text]))
    return outputs


def _precision_for(cfg: Config, device: torch.device) -> Precision:
    """The run's training precision (as validation used it) where this device allows it, else auto."""
    try:
        return pick_precision(cfg.train.precision, device)
    except UsageError:  # e.g. an fp16 run translated on a CPU
        return pick_precision("auto", device)
