"""`train.init_from`: the run a new run starts from (fine-tuning, domain adaptation): which of
its checkpoints, its weights, its tokenizers, and the model and tokenizer settings both must share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.config.loading import user_path
from transformer_mt.config.schema import Config, comparable_depths, config_to_dict, with_defaults
from transformer_mt.core.errors import CheckpointError, ConfigError, UsageError
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.runs.checkpoint import CheckpointDir, check_tokenizers, load_checkpoint, translation_weights

logger = logging.getLogger(__name__)

# What the parent's weights and tokenizers mean: the child must have the same.
SHARED_SECTIONS = ("model", "tokenizer")
# Settings of training only, which fine-tuning commonly changes: they do not change what the
# weights or the token ids mean (`model.max_len` sizes the sinusoidal positions, which are not
# weights, and the longest training pairs kept).
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
    (its `best.pt`, else its newest step checkpoint, as `tmt translate` picks) or a checkpoint
    in a run's `checkpoints/` folder (the run's tokenizers lie beside that folder)."""
    path = user_path(init_from)
    if path.is_dir():
        checkpoints = CheckpointDir(RunDir(path).checkpoints, keep_last=1)
        checkpoint = checkpoints.best_path if checkpoints.best_path.is_file() else checkpoints.latest()
        if checkpoint is None:
            raise UsageError(f"train.init_from: {init_from} holds no checkpoints/ to start from (not a trained "
                             "tmt run directory?)")
        return path.resolve(), checkpoint.resolve()
    if path.is_file():
        if path.resolve().parent.name != RunDir.CHECKPOINTS:
            raise UsageError(f"train.init_from: {init_from} is not in a run's {RunDir.CHECKPOINTS}/ folder; give the "
                             "run directory or one of its checkpoints (the run's tokenizers are needed too)")
        return path.resolve().parent.parent, path.resolve()
    raise UsageError(f"train.init_from: {init_from}: no such run directory or checkpoint")


def setting_conflicts(parent_config: dict, current: dict) -> list[str]:
    """One line per `model.*` or `tokenizer.*` key whose value differs from the parent's, with both
    (the settings of training only, `TRAINING_ONLY`, may differ; depths compare as the layers they
    give, `comparable_depths`)."""
    parent_config, current = comparable_depths(parent_config), comparable_depths(current)
    conflicts = []
    for section in SHARED_SECTIONS:
        before, after = parent_config.get(section) or {}, current.get(section) or {}
        for key in sorted(set(before) | set(after)):
            if f"{section}.{key}" not in TRAINING_ONLY and before.get(key) != after.get(key):
                conflicts.append(f"{section}.{key}: {before.get(key)!r} in the parent, {after.get(key)!r} here")
    return conflicts


def check_parent(cfg: Config) -> None:
    """Every check of `load_parent`, made by `tmt train` before it creates (or, with --overwrite,
    empties) the new run's directory, so that a refused start leaves nothing behind and deletes
    nothing, and by `tmt data`. It reads the parent's checkpoint, which `load_parent` reads again:
    a second or less at the sizes tmt trains."""
    _checked_parent(cfg)


def load_parent(cfg: Config) -> Parent:
    """Load the checkpoint `train.init_from` names; refuse one whose model or tokenizer settings
    differ from `cfg`'s (every differing key listed), or whose run lacks its tokenizers."""
    run_dir, path, state = _checked_parent(cfg)
    _warn_other_languages(state["config"].get("data") or {}, cfg)
    weights, which = translation_weights(state)
    step = state.get("train_state", {}).get("step")
    logger.info("starting from %s (step %s, its %s weights) with a fresh optimizer and step count", path, step,
                "EMA" if which == "ema" else "trained")
    record = {"run_dir": str(run_dir), "checkpoint": str(path), "step": step, "weights": which}
    return Parent(run_dir, path, weights, record)


def _checked_parent(cfg: Config) -> tuple[Path, Path, dict]:
    """The parent's run directory, checkpoint file and loaded checkpoint, checked."""
    run_dir, path = parent_paths(cfg.train.init_from)
    state = load_checkpoint(path)
    _refuse_conflicts(state["config"], cfg, run_dir, path)
    check_tokenizers(state, _parent_tokenizers(run_dir).fingerprint(), path, run_dir)
    return run_dir, path, state


def _refuse_conflicts(parent_config: dict, cfg: Config, run_dir: Path, path: Path) -> None:
    # Keys added to tmt since the parent was written count as their defaults, as on resume.
    conflicts = setting_conflicts(with_defaults(parent_config), config_to_dict(cfg))
    if conflicts:
        raise ConfigError([f"train.init_from: the model and tokenizer settings must be those of the parent "
                           f"{path} (see {RunDir(run_dir).config}); these differ:", *conflicts])


def _warn_other_languages(parent_data: dict, cfg: Config) -> None:
    """The parent may translate another pair (a new language on a joint vocabulary, a reversed
    direction): allowed, but its tokenizers, which this run keeps, were trained on its languages."""
    parent = (parent_data.get("src_lang"), parent_data.get("tgt_lang"))
    if parent != (cfg.data.src_lang, cfg.data.tgt_lang):
        logger.warning("train.init_from: the parent translates %s->%s and this run %s->%s; it keeps the parent's "
                       "tokenizers, trained on %s", *parent, cfg.data.src_lang, cfg.data.tgt_lang,
                       "both of the parent's languages (tokenizer.joint)" if cfg.tokenizer.joint
                       else f"its {parent[0]} text for the source and its {parent[1]} text for the target")


def copy_tokenizers(init_from: str, run_dir: Path) -> TokenizerPair:
    """Copy the parent run's tokenizers into `run_dir` (a new run's, or `tmt data`'s scratch folder)."""
    tokenizers = _parent_tokenizers(parent_paths(init_from)[0])
    tokenizers.save(run_dir)
    return tokenizers


def _parent_tokenizers(run_dir: Path) -> TokenizerPair:
    if not TokenizerPair.exists_in(run_dir):
        raise CheckpointError(f"train.init_from: {run_dir} has no tokenizer files, which its weights need")
    return TokenizerPair.load(run_dir)
