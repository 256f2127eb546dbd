"""The training loss: label-smoothed cross-entropy, and the training step's loss of a batch on the
plain path or the CPU fast path (`cpu_fast_path.real_positions_loss`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.batching import Batch
from transformer_mt.cpu_fast_path import real_positions_loss
from transformer_mt.model import Transformer


def label_smoothed_loss(logits: torch.Tensor, target_ids: torch.Tensor, pad_id: int, epsilon: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-pad targets (fp32), to be divided by token count.

    logits (B, T, V), target_ids (B, T) -> scalar; or any matching (..., V) and (...). ε is
    spread uniformly over all V classes (the gold one included), as PyTorch's `label_smoothing`
    does: loss = (1-ε)·NLL + ε·mean_v(-log p_v).
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target_ids.flatten(), ignore_index=pad_id,
                           label_smoothing=epsilon, reduction="sum")


class StepLoss(nn.Module):
    """What a training step differentiates: the summed label-smoothed loss of a batch under `model`.

    DDP and torch.compile wrap this module rather than the model, so that the CPU fast path,
    which walks the model's layers itself, runs inside DDP's forward (DDP arms its gradient
    all-reduce there). Its parameters are the model's, under a `model.` prefix; checkpoints save
    the model itself.
    """

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, tgt_out_ids: torch.Tensor, fast: bool,
                label_smoothing: float, product_dtype: torch.dtype | None = None) -> torch.Tensor:
        """(B, S), (B, T), (B, T) long -> fp32 scalar sum over the real targets. The model follows the
        caller's autocast; the loss is computed outside it (in fp32, the fast path's products in
        `product_dtype`)."""
        if fast:
            return real_positions_loss(self.model, src_ids, tgt_in_ids, tgt_out_ids, label_smoothing, product_dtype)
        logits = self.model(src_ids, tgt_in_ids)  # (B, T, V)
        with torch.autocast(device_type=src_ids.device.type, enabled=False):
            return label_smoothed_loss(logits, tgt_out_ids, self.model.pad_id, label_smoothing)


def step_loss(step_model: nn.Module, batch: Batch, fast: bool, label_smoothing: float,
              product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The summed label-smoothed loss of `batch` (fp32 scalar) through `step_model`, a `StepLoss`
    (possibly DDP-wrapped or compiled). `fast` takes the CPU fast path: every layer on the real
    positions only and the loss fused with the output projection, the same loss and gradients
    without the padding's share of the work (docs/benchmarks.md, "Training")."""
    return step_model(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, fast, label_smoothing, product_dtype)
