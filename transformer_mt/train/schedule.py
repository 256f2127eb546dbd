"""The learning rate as a pure function of the update number and `train.*`."""

from __future__ import annotations

import math

from transformer_mt.config.schema import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of update `step` (counted from 1): linear warmup to `train.lr` over
    `train.warmup_steps`, then the decay `train.lr_schedule` names.

    `inverse_sqrt` ∝ 1/sqrt(step) (Vaswani et al. 2017 §5.3, with the peak set directly), never
    below `train.min_lr`; `linear` and `cosine` (half a period, Loshchilov & Hutter 2017) from
    `train.lr` at the end of warmup to `train.min_lr` at `train.max_steps`. The rate depends on
    nothing but `step` and `train`, so a resumed run gets the rates of an uninterrupted one.
    """
    if step < train.warmup_steps:
        return train.lr * step / train.warmup_steps
    return _DECAYS[train.lr_schedule](step, train)


def _inverse_sqrt(step: int, train: TrainConfig) -> float:
    return max(train.lr * math.sqrt(max(train.warmup_steps, 1) / step), train.min_lr)


def _decay_progress(step: int, train: TrainConfig) -> float:
    """How far `step` is from the end of warmup (0) to `train.max_steps` (1)."""
    decay_steps = train.max_steps - train.warmup_steps
    return min((step - train.warmup_steps) / decay_steps, 1.0) if decay_steps > 0 else 1.0


def _linear(step: int, train: TrainConfig) -> float:
    return train.min_lr + (train.lr - train.min_lr) * (1 - _decay_progress(step, train))


def _cosine(step: int, train: TrainConfig) -> float:
    return train.min_lr + (train.lr - train.min_lr) * (1 + math.cos(math.pi * _decay_progress(step, train))) / 2


# One decay per `train.lr_schedule` choice (a test checks they match).
_DECAYS = {"inverse_sqrt": _inverse_sqrt, "linear": _linear, "cosine": _cosine}
