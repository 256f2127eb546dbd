"""The one place that builds a translation model from a config, and the interface the rest of tmt
uses of a model (decoding, training's FLOP count, checkpoints). A second architecture is one
module of its own plus a line in `build_model`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from transformer_mt.config import ModelConfig
from transformer_mt.kv_cache import KVCache
from transformer_mt.model import Transformer


class TranslationModel(Protocol):
    """What tmt needs of a model besides being an `nn.Module` with `forward(src_ids, tgt_in_ids) -> logits`."""

    cfg: ModelConfig
    pad_id: int

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) long, src_mask (B, S) bool -> memory (B, S, D)."""

    def decode(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: KVCache | None = None, fp32_logits: bool = True) -> torch.Tensor:
        """tgt_ids (B, T) long -> logits (B, T, V); with a cache, only the new positions."""

    def decode_best(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                    cache: KVCache | None = None, forbidden_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """(B,) long: each row's most probable next token after `decode`, none of `forbidden_ids`."""

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for incremental decoding of up to `capacity` target positions."""

    def num_parameters(self) -> int:
        """Trainable parameters, tied ones once."""

    def train_flops(self, src_lengths: Sequence[int] | np.ndarray, tgt_lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of one training step (forward + backward) over sentences of these lengths."""


def build_model(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int) -> Transformer:
    """A freshly initialised model of `cfg` (drawn from torch's default generator) for these vocabularies."""
    return Transformer(cfg, src_vocab_size, tgt_vocab_size, pad_id)
