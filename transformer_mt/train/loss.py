"""The training loss: label-smoothed cross-entropy (Szegedy et al. 2016; Vaswani et al. §5.4) of
the model's logits at the target rows of a batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.data.batching import Batch
from transformer_mt.model.transformer import Transformer


def label_smoothed_loss(logits: torch.Tensor, target_ids: torch.Tensor, pad_id: int, epsilon: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-pad targets (fp32), to be divided by token count.

    logits (N, V), target_ids (N,) -> scalar; or any matching (..., V) and (...). ε is spread
    uniformly over all V classes (the gold one included), as PyTorch's `label_smoothing` does:
    loss = (1-ε)·NLL + ε·mean_v(-log p_v).
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target_ids.flatten(), ignore_index=pad_id,
                           label_smoothing=epsilon, reduction="sum")


class StepLoss(nn.Module):
    """What a training step differentiates: the summed label-smoothed loss of a batch under `model`.

    DDP and torch.compile wrap this module, so that the loss runs inside their forward. Its
    parameters are the model's, under a `model.` prefix; checkpoints save the model itself.
    """

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, tgt_out_ids: torch.Tensor,
                label_smoothing: float, pack: bool = True) -> torch.Tensor:
        """(B, S), (B, T), (B, T) long -> fp32 scalar sum over the real targets. `pack`: the model
        computes at the real tokens only (else at every position: fixed shapes). The model follows
        the caller's autocast; the loss is computed in fp32 outside it."""
        logits = self.model(src_ids, tgt_in_ids, pack=pack)  # (Nt, V)
        targets = tgt_out_ids[tgt_in_ids != self.model.pad_id] if pack else tgt_out_ids.flatten()  # (Nt,)
        with torch.autocast(device_type=src_ids.device.type, enabled=False):
            return label_smoothed_loss(logits, targets, self.model.pad_id, label_smoothing)


def step_loss(step_model: nn.Module, batch: Batch, label_smoothing: float, pack: bool = True) -> torch.Tensor:
    """The summed label-smoothed loss of `batch` (fp32 scalar) through `step_model`, a `StepLoss`
    (possibly DDP-wrapped or compiled)."""
    return step_model(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, label_smoothing, pack)
