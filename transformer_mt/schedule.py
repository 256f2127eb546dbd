"""The learning-rate schedule: a pure function of the update number."""

from __future__ import annotations

import math


def lr_at(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Inverse-square-root schedule: linear warmup to `peak_lr`, then ∝ 1/sqrt(step).

    Equal to Vaswani et al. §5.3 with the peak set directly; `step` counts updates from 1.
    """
    warmup = max(warmup_steps, 1)
    return peak_lr * min(step / warmup, math.sqrt(warmup / step))
