"""The learning rate as a pure function of the update number and `train.*`."""

from __future__ import annotations

import math

from transformer_mt.config.schema import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of update `step` (counted from 1): linear warmup to `train.lr` over
    `train.warmup_steps`, then the decay `train.lr_schedule` names: `inverse_sqrt` ∝ 1/sqrt(step)
    (Vaswani et al. 2017 §5.3, the peak set directly) never below `train.min_lr`; `linear` and
    `cosine` (half a period) from `train.lr` at the end of warmup to `train.min_lr` at `train.max_steps`."""
    if step < train.warmup_steps:
        return train.lr * step / train.warmup_steps
    if train.lr_schedule == "inverse_sqrt":
        return max(train.lr * math.sqrt(max(train.warmup_steps, 1) / step), train.min_lr)
    decay_steps = train.max_steps - train.warmup_steps
    progress = min((step - train.warmup_steps) / decay_steps, 1.0) if decay_steps > 0 else 1.0  # 0 -> 1
    if train.lr_schedule == "linear":
        return train.min_lr + (train.lr - train.min_lr) * (1 - progress)
    return train.min_lr + (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress)) / 2  # cosine
