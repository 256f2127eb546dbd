"""The training loss: label-smoothed cross-entropy, optionally fused with the output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_loss(logits: torch.Tensor, target_ids: torch.Tensor, pad_id: int, epsilon: float,
                        output_weight: torch.Tensor | None = None,
                        product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-pad targets (fp32), to be divided by token count.

    logits (B, T, V), target_ids (B, T) -> scalar; or any matching (..., V) and (...). ε is
    spread uniformly over all V classes (the gold one included), as PyTorch's `label_smoothing`
    does: loss = (1-ε)·NLL + ε·mean_v(-log p_v), equal to `F.cross_entropy(...,
    ignore_index=pad_id, label_smoothing=ε, reduction="sum")` (tests/test_training_speed.py).

    With `output_weight` W (V, D), the first argument is instead the final states h (N, D),
    and the logits h·Wᵀ are computed inside, a block of rows at a time, never all at once
    (`_ProjectedLabelSmoothedNLL`). `product_dtype` (bf16 under bf16 autocast) is then the
    dtype of the projection's matrix products, as autocast would run it inside the model; the
    logits, the softmax and the loss are fp32 whatever it is.
    """
    if output_weight is not None:
        return _ProjectedLabelSmoothedNLL.apply(logits.float(), output_weight.float(), target_ids.flatten(),
                                                pad_id, epsilon, product_dtype or torch.float32)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target_ids.flatten(), ignore_index=pad_id,
                           label_smoothing=epsilon, reduction="sum")


class _ProjectedLabelSmoothedNLL(torch.autograd.Function):
    """`label_smoothed_loss` of the logits z = h·Wᵀ, fused with the projection, by blocks of rows.

    With lse = log Σ_v exp(z_v) per row: loss = lse - (1-ε)·z_gold - ε·mean_v(z_v), and
    d loss / d z = softmax(z) - (1-ε)·onehot(gold) - ε/V. That gradient is linear in the
    incoming gradient, so the forward pass computes, per block of rows, the block's logits,
    its loss and its contribution to d/dh (rows) and d/dW (summed), and discards the logits;
    backward only scales the two. The same products as projecting and then taking the loss
    (one forward and two backward matmuls), but each block's (rows, V) logits stay in cache
    and are reused from one block to the next, where an (N, V) tensor would be a fresh,
    page-faulted allocation every step, read and written several times by log-softmax,
    the NLL and smoothing terms and their backward.

    Blocks are `BLOCK_ROWS` rows whatever V is: with fewer rows the three products lose speed
    on a CPU (docs/benchmarks.md, "Loss blocks"), while the block's logits (8 MB at V = 8,000)
    still fit a CPU's last-level cache.
    """

    BLOCK_ROWS = 256

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, pad_id: int,
                epsilon: float, product_dtype: torch.dtype) -> torch.Tensor:
        # states (N, D) and weight (V, D) fp32, target_ids (N,) long
        (N, D), V = states.shape, weight.shape[0]
        rows = _ProjectedLabelSmoothedNLL.BLOCK_ROWS
        low = product_dtype != states.dtype  # bf16 products: inputs cast, results back to fp32
        weight_p = weight.to(product_dtype)  # (V, D), cast once (the same tensor when fp32)
        # (D, V), copied once per call: h·Wᵀ runs faster with Wᵀ contiguous than as a transposed view
        weight_t = weight_p.t().contiguous()
        counted = (target_ids != pad_id).to(states.dtype)  # (N,) 1 = a real target
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_states = states.new_empty(N, D) if grads else None
        grad_weight = torch.zeros_like(weight) if grads else None
        logits = states.new_empty(min(rows, N), V)  # one block's fp32 logits, reused by every block
        loss = states.new_zeros(())
        for i in range(0, N, rows):
            h, gold_ids, scale = states[i:i + rows], target_ids[i:i + rows, None], counted[i:i + rows, None]
            h_p = h.to(product_dtype)
            z = logits[:h.shape[0]]  # (r, V)
            if low:
                z.copy_(torch.mm(h_p, weight_t))
            else:
                torch.mm(h, weight_t, out=z)
            z_gold, z_sum = z.gather(1, gold_ids), z.sum(dim=1, keepdim=True)  # (r, 1) each
            z_max = z.amax(dim=1, keepdim=True)
            e = z.sub_(z_max).exp_()  # (r, V) exp(z - max), in the logits' buffer: one exp per logit
            e_sum = e.sum(dim=1, keepdim=True)
            lse = z_max + e_sum.log()  # (r, 1) log Σ_v exp(z_v)
            per_row = lse - (1.0 - epsilon) * z_gold - (epsilon / V) * z_sum
            loss += (per_row * scale).sum()
            if grads:
                # (softmax - ε/V) · [real], softmax = e / Σe, in the same buffer
                grad = torch.addcmul(-(epsilon / V) * scale, e, scale / e_sum, out=e)
                grad.scatter_add_(1, gold_ids, -(1.0 - epsilon) * scale)
                if low:  # as autocast's backward would: the gradient cast, the products summed in fp32
                    grad_p = grad.to(product_dtype)
                    grad_states[i:i + rows] = torch.mm(grad_p, weight_p)  # (r, D)
                    grad_weight += torch.mm(grad_p.t(), h_p)  # (V, D)
                else:  # in place: no temporaries
                    torch.mm(grad, weight, out=grad_states[i:i + rows])  # (r, D)
                    grad_weight.addmm_(grad.t(), h)  # (V, D)
        ctx.save_for_backward(grad_states, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_states, grad_weight = ctx.saved_tensors
        return grad_states * grad_loss, grad_weight * grad_loss, None, None, None, None
