"""The training loss: label-smoothed cross-entropy of the output layer, the module a training step
differentiates, and what that module takes of a batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.data.batching import Batch
from transformer_mt.model.transformer import Transformer


class _OutputLayerLoss(torch.autograd.Function):
    """The output layer and its label-smoothed cross-entropy, summed over the rows whose target is not
    pad. The logits' gradient is computed in the forward, in the logits' own buffer: one (N, V)
    tensor where autograd through `F.cross_entropy` keeps four (logits, log-probabilities, their
    gradient, the logits' gradient), each written and read in full; with V in the tens of thousands
    this loss is the costliest elementwise work of a step."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target_ids: torch.Tensor,
                pad_id: int, epsilon: float) -> torch.Tensor:
        # Row loss = (1-ε)·(lse - z_t) + ε·mean_v(lse - z_v) = lse - (1-ε)·z_t - ε/V·Σ_v z_v  (lse: log Σ exp z)
        z = F.linear(states, weight, bias).float()  # (N, V) logits
        vocab = z.shape[1]
        real = (target_ids != pad_id)[:, None]  # (N, 1)
        gold = z.gather(1, target_ids[:, None])  # (N, 1)
        logit_sum = z.sum(1, keepdim=True)  # (N, 1)
        top = z.amax(1, keepdim=True)  # (N, 1)
        p = z.sub_(top).exp_()  # (N, V) exp(z - max), in place
        total = p.sum(1, keepdim=True)  # (N, 1)
        row_loss = top + total.log() - (1 - epsilon) * gold - epsilon / vocab * logit_sum
        loss = torch.where(real, row_loss, 0.0).sum()
        if any(ctx.needs_input_grad[:3]):
            # d loss / d z = softmax - (1-ε)·onehot(target) - ε/V, zero on pad rows
            scale = real / total
            torch.addcmul(real * (-epsilon / vocab), p, scale, out=p)
            p.scatter_add_(1, target_ids[:, None], real * (epsilon - 1.0))
            ctx.save_for_backward(p, states, weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_z, states, weight = ctx.saved_tensors  # (N, V) fp32, (N, D), (V, D) in the logits' dtype
        g = grad_z.to(states.dtype)
        grad_states = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_states = (g @ weight).mul_(grad_loss)  # (N, D)
        if ctx.needs_input_grad[1]:
            grad_weight = g.t() @ (states * grad_loss)  # (V, D): the scalar on the small operand
        if ctx.needs_input_grad[2]:  # False for a None bias
            grad_bias = (grad_z.sum(0) * grad_loss).to(states.dtype)  # (V,)
        return grad_states, grad_weight, grad_bias, None, None, None


def label_smoothed_loss(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        target_ids: torch.Tensor, pad_id: int, epsilon: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy of the output layer, weight (V, D) and bias (V,) or None,
    over final decoder states (N, D) and their targets (N,) long, pad targets ignored:
    (1-ε)·NLL + ε·mean_v(-log p_v) (ε spread over all V classes, the gold one included), in fp32;
    `F.cross_entropy(F.linear(states, weight, bias), label_smoothing=ε)`. The logits take the
    operands' dtype (`Transformer.output_operands`), whatever the caller's autocast."""
    with torch.autocast(device_type=states.device.type, enabled=False):
        return _OutputLayerLoss.apply(states, weight, bias, target_ids, pad_id, epsilon)


class StepLoss(nn.Module):
    """The summed label-smoothed loss of a batch under `model`: what a training step differentiates
    (DDP and torch.compile wrap this module, so that the loss runs inside their forward) and
    validation sums (ε 0)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, tgt_out_ids: torch.Tensor,
                label_smoothing: float, pack: bool = True,
                offsets: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """(B, S), (B, T), (B, T) long -> fp32 scalar sum over the real targets; `pack`: the model
        computes at the real tokens only; `offsets`: a packed batch's (`Transformer.forward`). The
        model follows the caller's autocast, the loss not."""
        states = self.model.target_states(src_ids, tgt_in_ids, pack=pack, offsets=offsets)  # (Nt, D)
        rows_only = pack and offsets is None
        targets = tgt_out_ids[tgt_in_ids != self.model.pad_id] if rows_only else tgt_out_ids.flatten()  # (Nt,)
        return label_smoothed_loss(*self.model.output_operands(states), targets, self.model.pad_id,
                                   label_smoothing)


def batch_offsets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """What `StepLoss` takes of a packed batch (None: padded)."""
    return (batch.src_offsets, batch.tgt_offsets, batch.longest) if batch.packed else None
