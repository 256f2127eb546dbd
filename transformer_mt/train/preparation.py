"""What a training run needs before its first step: the corpus, the tokenizers, the token caches
and the data report, prepared once in the run directory."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from transformer_mt.config.schema import Config, TrainConfig, frozen_prefixes
from transformer_mt.core.errors import DataError, TmtError, missing_from_rank0
from transformer_mt.core.files import os_errors_named, write_new_dir
from transformer_mt.core.run_layout import JOINT_FILE, SRC_FILE, TGT_FILE, RunDir
from transformer_mt.core.runtime import pick_device
from transformer_mt.data import corpus as data_module
from transformer_mt.data.filters import REMOVED_DIR
from transformer_mt.data.report import DataReport, FrozenParts, build_report
from transformer_mt.data.token_cache import TokenizedSplit, processes_for, tokenize_split
from transformer_mt.data.tokenization import PAD_ID, TokenizerPair, train_tokenizers
from transformer_mt.data.training_split import tokenize_training_split
from transformer_mt.model.transformer import build_model
from transformer_mt.runs.init_from import copy_tokenizers
from transformer_mt.runs.run_dir import data_settings_problem
from transformer_mt.train.batches import packed_batches, resolve_batch_tokens

logger = logging.getLogger(__name__)


def batch_padding(train_cfg: TrainConfig, device_type: str) -> int:
    """The multiple that batch lengths are padded to: `train.pad_to_multiple` on CUDA (tensor cores)
    or under compile (fewer distinct shapes), else 1 (on a CPU it only costs time)."""
    return train_cfg.pad_to_multiple if device_type == "cuda" or train_cfg.compile else 1


def prepare_data(cfg: Config, run_dir: Path, progress: bool = False, world_size: int = 1, pad_to_multiple: int = 1,
                 prepared: bool = False, packed: bool = False
                 ) -> tuple[TokenizerPair, TokenizedSplit, TokenizedSplit, DataReport | None]:
    """Load the corpus, train (or reuse, or copy from `train.init_from`) the tokenizers, tokenize the
    train and valid splits once (cached in the run directory), and log the data report (batches
    counted with lengths padded to `pad_to_multiple`, or packs with `packed`). `prepared`: rank 0 of a torchrun run has just
    done all this in `run_dir`; only read what it wrote (the other ranks; no data report then)."""
    corpus = data_module.load_corpus(cfg.data, cfg.seed, run_dir, prepared=prepared)
    if TokenizerPair.exists_in(run_dir):
        tokenizers = TokenizerPair.load(run_dir)
        logger.info("reusing the tokenizers in %s", run_dir)
    elif prepared:
        raise missing_from_rank0(RunDir(run_dir).tokenizer_file(cfg.tokenizer.joint))
    elif cfg.train.init_from:  # a new run from another's weights: that run's vocabulary
        tokenizers = copy_tokenizers(cfg.train.init_from, run_dir)
        logger.info("copied the tokenizers of %s (train.init_from)", cfg.train.init_from)
    else:
        started = time.perf_counter()
        rows = data_module.sample_rows(len(corpus.train), cfg.tokenizer.train_pairs, cfg.seed)
        if rows is not None:
            logger.info("training the tokenizers on %d of the %d training pairs (tokenizer.max_train_pairs)",
                        len(rows), len(corpus.train))
        tokenizers = train_tokenizers(cfg.tokenizer, data_module.iter_text(corpus.train, "src", rows),
                                      data_module.iter_text(corpus.train, "tgt", rows), progress,
                                      n_lines=len(corpus.train) if rows is None else len(rows), tags=cfg.data.tags)
        tokenizers.save(run_dir)
        logger.info("trained BPE tokenizers (vocabulary %d%s) in %.1fs", tokenizers.src.get_vocab_size(),
                    ", joint" if tokenizers.joint else "", time.perf_counter() - started)
    missing = [tag for tag in cfg.data.tags if tag not in tokenizers.language_tags]
    if missing:
        origin = "train.init_from's" if cfg.train.init_from else "the run's"
        raise DataError(f"data.corpora: {origin} tokenizers have no token {missing[0]}; a corpus's target_lang needs "
                        "a tag the vocabulary has (a new run trains its tokenizers with the tags)")
    cache = RunDir(run_dir).token_cache
    # Every corpus's pairs, and with tokenizer.bpe_dropout their cached dropout segmentations.
    train = tokenize_training_split(cfg, corpus, tokenizers, cache, progress=progress, prepared=prepared)
    # Evaluation sets are never filtered; their over-long sentences are truncated instead.
    valid = tokenize_split(corpus.valid, corpus.digests["valid"], tokenizers, cfg.model.max_len, cache, "valid",
                           drop_long=False, keep_text=True, num_proc=processes_for(len(corpus.valid), cfg.data.num_proc),
                           progress=progress, prepared=prepared)
    if prepared:
        return tokenizers, train, valid, None  # rank 0 reports the data (a pass over all of train)
    report = build_report(cfg, corpus, tokenizers, train, world_size, pad_to_multiple, packed)
    report = dataclasses.replace(report, frozen=frozen_parts(cfg, tokenizers))
    logger.info("data report:\n%s", report.render())
    return tokenizers, train, valid, report


def frozen_parts(cfg: Config, tokenizers: TokenizerPair) -> FrozenParts | None:
    """What `train.freeze` leaves untrained, counted on a model of `tokenizers`' vocabularies that
    holds no memory (and draws no random numbers); None without train.freeze."""
    if not cfg.train.freeze:
        return None
    with torch.device("meta"):
        model = build_model(cfg.model, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), PAD_ID)
    return FrozenParts(cfg.train.freeze, model.freeze(frozen_prefixes(cfg.train.freeze)), model.num_parameters())


def preview_report(cfg: Config, run_dir: Path, progress: bool,
                   removed_to: Path | None = None) -> tuple[DataReport, list[str], bool]:
    """`tmt data`: the data report of `cfg` prepared in a temporary folder, leaving no file behind but the
    pairs `data.filters` removed in the new folder `removed_to` (`check_new_dir`'d) when given
    -> (report, notes for the user, whether `run_dir`'s tokenizers were used). An existing run's
    tokenizers, carved split and first BPE-dropout segmentation (not seeded: drawn again, it would
    give other lengths) are copied there first when the run has the same seed, data and tokenizer
    settings, so the report describes that run."""
    notes = []
    reuse = data_settings_problem(cfg, run_dir) is None  # the same seed, data and tokenizer settings
    with tempfile.TemporaryDirectory(prefix="tmt-data-") as scratch:
        if reuse:
            for name in (RunDir.SPLITS, JOINT_FILE, SRC_FILE, TGT_FILE):
                if (run_dir / name).is_file():
                    shutil.copyfile(run_dir / name, Path(scratch) / name)
            for entry in sorted(RunDir(run_dir).token_cache.glob("train*.v1-*")):  # epoch 1's variant
                if entry.is_dir():
                    shutil.copytree(entry, RunDir(Path(scratch)).token_cache / entry.name)
        device_type = cfg.train.device if cfg.train.device != "auto" else pick_device().type
        if cfg.train.batch_tokens == "auto" and device_type == "cuda" and not torch.cuda.is_available():
            notes.append("train.batch_tokens auto: batches counted at 4,096 tokens here, as on a CPU; on a GPU "
                         "the budget is sized for its memory")
        here = torch.device(device_type if device_type != "cuda" or torch.cuda.is_available() else "cpu")
        cfg, budget_note = resolve_batch_tokens(cfg, here)
        notes += [budget_note] if budget_note else []
        # The report describes the first epoch and BPE-dropout segmentation: drawing others costs time.
        variants = cfg.tokenizer.bpe_dropout_variants
        report_cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, bpe_dropout_variants=1))
        try:
            *_, report = prepare_data(report_cfg, Path(scratch), progress=progress,
                                      pad_to_multiple=batch_padding(cfg.train, device_type),
                                      packed=packed_batches(cfg, torch.device(device_type)))
        except TmtError as err:  # name the run's file (a damaged splits.json, say), not its scratch copy
            err.args = tuple(str(arg).replace(scratch, str(run_dir)) for arg in err.args)
            raise
        if removed_to is not None and report.filtered:
            removed = RunDir(Path(scratch)).corpus_cache / REMOVED_DIR
            with os_errors_named("the removed pairs", removed_to):
                write_new_dir(removed_to, lambda folder: [shutil.copyfile(file, folder / file.name)
                                                          for file in sorted(removed.iterdir())])
    if removed_to is not None and report.filtered:
        report = dataclasses.replace(report, removed_at=f"in {removed_to}{os.sep}")
    elif report.filtered:
        report = dataclasses.replace(report, removed_at="with --removed DIR in DIR/, by tmt train in the run "
                                                        "directory's corpus_cache/removed/")
    if report.bpe_dropout is not None:
        report = dataclasses.replace(report, bpe_dropout=(report.bpe_dropout[0], variants, *report.bpe_dropout[2:]))
    return report, notes, reuse
