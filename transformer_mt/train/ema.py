"""An exponential moving average (EMA) of a model's weights (`train.ema_decay`), in fp32 on the
training device, whose weights validation, `best.pt`, the final test and `tmt translate` then use."""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightEMA:
    """`model` holds the average: a copy of the trained model, never trained itself. Each
    `update` (after an optimizer update) moves it towards the trained weights:
    ema ← d·ema + (1 − d)·weights, with d = min(decay, (1 + n) / (10 + n)) at the n-th update
    (the warm-up of d keeps early averages off the random initial weights)."""

    def __init__(self, trained: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0  # averaged updates so far: the n of the warm-up
        self.model = copy.deepcopy(trained).float().eval().requires_grad_(False)
        # Parameters in the same order on both sides; a tied weight is one parameter on each.
        self._trained = list(trained.parameters())
        self._average = list(self.model.parameters())

    def decay_at(self, n: int) -> float:
        """The decay of the n-th update (n ≥ 1)."""
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the trained weights into the average; call it after each update that happened."""
        self.updates += 1
        # lerp_(end, w) = self + w·(end − self) = (1 − w)·self + w·end: one fused kernel per dtype and device.
        trained = [p.detach().float() for p in self._trained]  # no copy when already fp32
        torch._foreach_lerp_(self._average, trained, 1.0 - self.decay_at(self.updates))

    def reset(self) -> None:
        """Start the average afresh from the trained weights (n = 0)."""
        with torch.no_grad():
            torch._foreach_copy_(self._average, [p.detach().float() for p in self._trained])
        self.updates = 0

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore an average; the decay stays this run's (`train.ema_decay` may change on resume)."""
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])

