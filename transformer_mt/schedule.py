"""The learning rate as a pure function of the update number and `train.*`."""

from __future__ import annotations

import math

from transformer_mt.config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of update `step` (counted from 1) under `train.lr_schedule`.

    Every schedule warms up linearly to `train.lr` over `train.warmup_steps`, then decays:
    `inverse_sqrt` ∝ 1/sqrt(step) (Vaswani et al. §5.3 with the peak set directly), never below
    `train.min_lr`; `linear` and `cosine` from `train.lr` at the end of warmup to `train.min_lr`
    at `train.max_steps` (cosine: half a period, Loshchilov & Hutter 2017), which the last
    update uses. The rate depends on nothing but `step` and these keys, so a resumed run gets
    exactly the rates of an uninterrupted one; and since train.* may change on resume, a changed
    schedule, peak, floor or `max_steps` sets the rate from the next update on (the curve jumps).
    """
    return _SCHEDULES[train.lr_schedule](step, train)


def _inverse_sqrt(step: int, train: TrainConfig) -> float:
    warmup = max(train.warmup_steps, 1)
    if step < warmup:
        return train.lr * (step / warmup)  # the arithmetic of tmt before the other schedules: the same floats
    return max(train.lr * math.sqrt(warmup / step), train.min_lr)


def _decay_progress(step: int, train: TrainConfig) -> float:
    """How far `step` is from the end of warmup (0) to `train.max_steps` (1)."""
    decay_steps = train.max_steps - train.warmup_steps
    if decay_steps <= 0:
        return 1.0
    return min(max(step - train.warmup_steps, 0) / decay_steps, 1.0)


def _linear(step: int, train: TrainConfig) -> float:
    if step < train.warmup_steps:
        return train.lr * (step / train.warmup_steps)
    return train.min_lr + (train.lr - train.min_lr) * (1 - _decay_progress(step, train))


def _cosine(step: int, train: TrainConfig) -> float:
    if step < train.warmup_steps:
        return train.lr * (step / train.warmup_steps)
    return train.min_lr + (train.lr - train.min_lr) * (1 + math.cos(math.pi * _decay_progress(step, train))) / 2


# One entry per `train.lr_schedule` choice (a test checks they match).
_SCHEDULES = {"inverse_sqrt": _inverse_sqrt, "linear": _linear, "cosine": _cosine}
