"""The interface tmt uses of a translation model, and `build_model`, the one place that builds one
(a second architecture: a module of its own plus a line there)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from transformer_mt.config.schema import ModelConfig
from transformer_mt.model.transformer import KVCache, Transformer


class TranslationModel(Protocol):
    """What tmt needs of a model besides being an `nn.Module`."""

    cfg: ModelConfig
    pad_id: int

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, pack: bool = True) -> torch.Tensor:
        """Teacher-forced logits (Nt, V) at the target rows (`pack`: real tokens only)."""

    def new_cache(self, src_ids: torch.Tensor, capacity: int, rows_per_sentence: int = 1) -> KVCache:
        """Encode src_ids (B, S) into a static cache for decoding up to `capacity` positions."""

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Input tokens (R,) at `cache.position` -> fp32 logits (R, V) of the next token."""

    def num_parameters(self) -> int:
        """Trainable parameters, tied ones once."""

    def train_flops(self, src_lengths: Sequence[int] | np.ndarray, tgt_lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of one training step (forward + backward) over sentences of these lengths."""


def build_model(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int) -> Transformer:
    """A freshly initialised model of `cfg` (drawn from torch's default generator) for these vocabularies."""
    return Transformer(cfg, src_vocab_size, tgt_vocab_size, pad_id)
