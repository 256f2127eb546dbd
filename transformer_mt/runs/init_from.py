"""`train.init_from`: the run a new run starts from (fine-tuning): its checkpoint, weights and
tokenizers, and the model and tokenizer settings both must share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.config.loading import read_saved_config, user_path
from transformer_mt.config.schema import Config, config_changes, config_to_dict
from transformer_mt.core.errors import CheckpointError, ConfigError, UsageError
from transformer_mt.core.files import write_text_atomic
from transformer_mt.core.run_layout import JOINT_FILE, SRC_FILE, TGT_FILE, RunDir, best_or_latest
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.checkpoint import check_tokenizers, load_checkpoint, translation_weights

logger = logging.getLogger(__name__)

# What the parent's weights and tokenizers mean: the child must have the same.
SHARED_SECTIONS = ("model", "tokenizer")
# Settings of training only, which fine-tuning may change: not what the weights or the token ids mean.
TRAINING_ONLY = {"model.dropout", "model.attention_dropout", "model.activation_dropout", "model.max_len",
                 "tokenizer.bpe_dropout", "tokenizer.bpe_dropout_variants", "tokenizer.bpe_dropout_start_epoch"}


@dataclass(frozen=True)
class Parent:
    """The checkpoint a run starts from, loaded and checked against the run's config."""

    run_dir: Path
    checkpoint: Path
    weights: dict  # a model state dict: the checkpoint's EMA weights when it has them
    record: dict  # what `summary.json` says of it (`init_from`)


def parent_paths(init_from: str) -> tuple[Path, Path]:
    """The run directory and the checkpoint file that `train.init_from` names: a run directory
    (the checkpoint `tmt translate` picks) or a checkpoint in a run's `checkpoints/` folder."""
    path = user_path(init_from)
    if path.is_dir():
        if (checkpoint := best_or_latest(RunDir(path).checkpoints)) is None:
            raise UsageError(f"train.init_from: {init_from} holds no checkpoints/ to start from (not a trained "
                             "tmt run directory?)")
        return path.resolve(), checkpoint.resolve()
    if path.is_file():
        if path.resolve().parent.name != RunDir.CHECKPOINTS:
            raise UsageError(f"train.init_from: {init_from} is not in a run's {RunDir.CHECKPOINTS}/ folder; give the "
                             "run directory or one of its checkpoints (the run's tokenizers are needed too)")
        return path.resolve().parent.parent, path.resolve()
    raise UsageError(f"train.init_from: {init_from}: no such run directory or checkpoint")


def load_parent(cfg: Config) -> Parent:
    """Load the checkpoint `train.init_from` names, checked (`check_parent`)."""
    run_dir, path, state = check_parent(cfg)
    parent_data = state["config"].get("data") or {}
    parent = (parent_data.get("src_lang"), parent_data.get("tgt_lang"))
    if parent != (cfg.data.src_lang, cfg.data.tgt_lang):  # allowed, but the tokenizers know its languages
        logger.warning("train.init_from: the parent translates %s->%s and this run %s->%s; it keeps the parent's "
                       "tokenizers, trained on %s", *parent, cfg.data.src_lang, cfg.data.tgt_lang,
                       "both of the parent's languages (tokenizer.joint)" if cfg.tokenizer.joint
                       else f"its {parent[0]} text for the source and its {parent[1]} text for the target")
    weights, which = translation_weights(state)
    step = state.get("train_state", {}).get("step")
    logger.info("starting from %s (step %s, its %s weights) with a fresh optimizer and step count", path, step,
                "EMA" if which == "ema" else "trained")
    record = {"run_dir": str(run_dir), "checkpoint": str(path), "step": step, "weights": which}
    return Parent(run_dir, path, weights, record)


def inherited_settings(cfg: Config, resumed_run: Path | None = None) -> dict:
    """The model and tokenizer settings of `cfg`'s parent (`train.init_from`), which a config that
    gives none takes (`load_config`'s `inherit`): those of its checkpoint, or for a resumed run those
    of `resumed_run`'s own config.yaml, which holds them from its start (the parent may be gone)."""
    saved = read_saved_config(RunDir(resumed_run).config) if resumed_run is not None else None
    if saved is None:
        saved = load_checkpoint(parent_paths(cfg.train.init_from)[1], mmap=True)["config"]
    return {section: saved[section] for section in SHARED_SECTIONS if isinstance(saved.get(section), dict)}


def check_parent(cfg: Config) -> tuple[Path, Path, dict]:
    """The parent's run directory, checkpoint file and loaded checkpoint; refused when its model or
    tokenizer settings differ from `cfg`'s (every key listed) or its run lacks tokenizers. `tmt train`
    and `tmt data` call it before creating anything."""
    run_dir, path = parent_paths(cfg.train.init_from)
    state = load_checkpoint(path, mmap=True)  # its config and fingerprint: the weights stay on disk
    conflicts = [f"{key}: {old!r} in the parent, {new!r} here" for key, old, new in
                 config_changes(state["config"], config_to_dict(cfg))
                 if key.partition(".")[0] in SHARED_SECTIONS and key not in TRAINING_ONLY]
    if conflicts:
        raise ConfigError([f"train.init_from: the model and tokenizer settings must be those of the parent "
                           f"{path} (see {RunDir(run_dir).config}); these differ:", *conflicts])
    tokenizers = _parent_tokenizers(run_dir)
    check_tokenizers(state, tokenizers.fingerprint(), path, run_dir)
    if cfg.tokenizer.bpe_dropout and tokenizers.kind != "BPE":  # it would change nothing
        raise ConfigError([f"tokenizer.bpe_dropout: {cfg.tokenizer.bpe_dropout} does nothing with the "
                           f"{tokenizers.kind} tokenizers of {run_dir} (train.init_from); BPE-dropout needs BPE "
                           "tokenizers: set it to 0"])
    return run_dir, path, state


def copy_tokenizers(init_from: str, run_dir: Path) -> TokenizerPair:
    """Copy the parent run's tokenizer files into `run_dir` (a new run's, or `tmt data`'s scratch
    folder) as they are: loading and saving again may change a Unigram score in its last digit."""
    parent = parent_paths(init_from)[0]
    tokenizers = _parent_tokenizers(parent)
    for name in [JOINT_FILE] if tokenizers.joint else [TGT_FILE, SRC_FILE]:  # as TokenizerPair.save orders them
        write_text_atomic(run_dir / name, (parent / name).read_text(encoding="utf-8"))
    return tokenizers


def _parent_tokenizers(run_dir: Path) -> TokenizerPair:
    if not TokenizerPair.exists_in(run_dir):
        raise CheckpointError(f"train.init_from: {run_dir} has no tokenizer files, which its weights need")
    return TokenizerPair.load(run_dir)
