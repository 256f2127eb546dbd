"""The training loss: label-smoothed cross-entropy, the module a training step differentiates,
and what that module takes of a batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.data.batching import Batch
from transformer_mt.model.transformer import Transformer


def label_smoothed_loss(logits: torch.Tensor, target_ids: torch.Tensor, pad_id: int, epsilon: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-pad targets in fp32: logits (..., V), target_ids
    (...) -> scalar, (1-ε)·NLL + ε·mean_v(-log p_v) (ε spread over all V classes, the gold one included)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target_ids.flatten(), ignore_index=pad_id,
                           label_smoothing=epsilon, reduction="sum")


class StepLoss(nn.Module):
    """What a training step differentiates: the summed label-smoothed loss of a batch under `model`
    (DDP and torch.compile wrap this module, so that the loss runs inside their forward)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, tgt_out_ids: torch.Tensor,
                label_smoothing: float, pack: bool = True,
                offsets: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """(B, S), (B, T), (B, T) long -> fp32 scalar sum over the real targets; `pack`: the model
        computes at the real tokens only; `offsets`: a packed batch's (`Transformer.forward`). The
        model follows the caller's autocast, the loss not."""
        logits = self.model(src_ids, tgt_in_ids, pack=pack, offsets=offsets)  # (Nt, V)
        rows_only = pack and offsets is None
        targets = tgt_out_ids[tgt_in_ids != self.model.pad_id] if rows_only else tgt_out_ids.flatten()  # (Nt,)
        with torch.autocast(device_type=src_ids.device.type, enabled=False):
            return label_smoothed_loss(logits, targets, self.model.pad_id, label_smoothing)


def batch_offsets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """What `StepLoss` takes of a packed batch (None: padded)."""
    return (batch.src_offsets, batch.tgt_offsets, batch.longest) if batch.packed else None
