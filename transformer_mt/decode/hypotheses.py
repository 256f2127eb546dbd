"""What a search returns and how it ranks: `Hypothesis`, the length penalty, each sentence's
length cap, and the settings of sampling; torch-free, for every engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor


def length_penalty(length: int, alpha: float) -> float:
    """length^α, `length` the generated tokens with the EOS (a target prefix's too), as CTranslate2,
    transformers and fairseq divide a hypothesis's log-probability; α = 0 turns it off."""
    return float(length) ** alpha


def length_caps(source_lengths: list[int], max_len_a: float, max_len_b: int, model_max_len: int) -> list[int]:
    """Each sentence's cap on generated tokens, EOS (and a target prefix) included: a·S + b for S
    source tokens with EOS, in [1, model_max_len]; in fp32, as `generator.max_target_lengths` on tensors."""
    lengths = np.array(source_lengths, dtype=np.float32)
    limits = np.floor(np.float32(max_len_a) * lengths + np.float32(max_len_b))
    return [int(cap) for cap in np.clip(limits, 1, model_max_len)]


@dataclass(frozen=True)
class Hypothesis:
    """A finished translation: ids (no BOS/EOS), summed log-probability (EOS included), and its score,
    log-probability / length penalty."""

    ids: list[int]
    log_prob: float
    score: float


def strip_generated(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Generated ids up to (not including) the first EOS or padding."""
    return list(itertools.takewhile(lambda token: token not in (eos_id, pad_id), ids))


@dataclass(frozen=True)
class Sampling:
    """Draw each next token from the model's distribution at `temperature`, cut to the `top_k` most
    probable tokens (0: no cut), then to the smallest set reaching probability `top_p` (nucleus
    sampling; 1: no cut), from a generator seeded with `seed` (same seed, same samples)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature > 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

    def probabilities(self, logits: Tensor) -> Tensor:
        """logits (N, V) float -> the distribution to draw from (N, V), zero outside the cuts."""
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth_best = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth_best, float("-inf"))
        probs = logits.softmax(dim=-1)  # (N, V)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # (N, V) each
            # Drop a token once the more probable ones before it reach top_p; the best always stays.
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # (N, V)
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        return probs
