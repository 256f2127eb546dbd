"""A run's checkpoint loaded with torch for translating, checked against the run's tokenizers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import Config
from transformer_mt.core.errors import CheckpointError, ConfigError
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.model.architectures import build_model
from transformer_mt.model.transformer import Transformer
from transformer_mt.runs.checkpoint import check_tokenizers, check_vocabulary, load_checkpoint, translation_weights
from transformer_mt.runs.run_files import find_checkpoint


@dataclass(frozen=True)
class LoadedRun:
    """A run's checkpoint loaded with torch and checked against the run's tokenizers."""

    model: Transformer  # the translation weights (EMA's when the run keeps them), on the CPU, in eval mode
    tokenizers: TokenizerPair
    checkpoint: Path
    cfg: Config
    config: dict  # the config as saved in the checkpoint
    model_args: dict
    step: int
    which: str  # "ema" or "model" (`checkpoint.translation_weights`)


def load_run(run_dir: Path, checkpoint: Path | None = None, tokenizers: TokenizerPair | None = None) -> LoadedRun:
    """Load a run directory's `best.pt` (else its newest step checkpoint) or `checkpoint` with
    torch: its EMA weights when it has them (`train.ema_decay`), else its trained weights."""
    if checkpoint is None:
        checkpoint = find_checkpoint(run_dir)
    state = load_checkpoint(checkpoint)
    cfg = _run_config(state["config"], checkpoint)
    tokenizers = tokenizers or TokenizerPair.load(run_dir)
    check_tokenizers(state, tokenizers.fingerprint(), checkpoint, run_dir)
    args = state["model_args"]
    check_vocabulary(args, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), run_dir)
    model = build_model(cfg.model, args["src_vocab_size"], args["tgt_vocab_size"], args["pad_id"])
    weights, which = translation_weights(state)
    model.load_state_dict(weights)
    return LoadedRun(model.eval(), tokenizers, checkpoint, cfg, state["config"], args,
                     state.get("train_state", {}).get("step", -1), which)


def _run_config(saved: dict, checkpoint: Path) -> Config:
    """The config a checkpoint was saved with."""
    try:
        return config_from_dict(saved)
    except ConfigError as err:
        raise CheckpointError(f"{checkpoint}: the config stored in the checkpoint is invalid ({err})") from None
