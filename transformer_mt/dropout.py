"""Dropout drawn through the gaps between dropped elements: the same Bernoulli(p) distribution
as `nn.Dropout` from about n·p random numbers instead of n, for training on a CPU, where
drawing the masks (`bernoulli_`) was 18% of a step. Attention dropout goes the same way there.
Used by `cpu_fast_path` only (`cpu_fast_path.dropout`).
"""

from __future__ import annotations

import math

import torch


def dropped_positions(n: int, p: float, chunk: int | None = None) -> torch.Tensor:
    """Positions (long, sorted) that dropout with rate p zeroes among n elements: each one
    independently with probability p, drawn through the gaps between drops.

    A Bernoulli(p) sequence is the same thing as its gaps, independent Geometric(p) counts
    (P(gap = g) = (1-p)^(g-1)·p, g >= 1), so drawing about n·p gaps by inversion of a float64
    uniform v in (0, 1], g = floor(log v / log(1-p)) + 1, gives the same distribution as n
    Bernoulli draws at a p-th of the random numbers. Draws come from torch's default generator,
    so `torch.manual_seed` fixes them. Gaps are drawn `chunk` at a time until they pass n
    (default: enough to pass it almost always at the first draw).
    """
    if n == 0:
        return torch.empty(0, dtype=torch.long)
    log_keep = math.log1p(-p)
    chunks, covered = [], 0  # covered: positions decided so far, 0 .. covered - 1
    while covered < n:
        expected = (n - covered) * p
        count = chunk or int(expected + 6 * math.sqrt(expected) + 16)  # nearly always enough to pass n
        v = torch.rand(count, dtype=torch.float64).neg_().add_(1.0)  # uniform in (0, 1]
        gaps = v.log_().div_(log_keep).floor_().add_(1.0)  # Geometric(p), exact integers in float64
        positions = gaps.cumsum_(0).add_(covered - 1)  # where each drop falls
        chunks.append(positions)
        covered = int(positions[-1].item()) + 1  # everything up to the last drop is decided
    positions = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    return positions[: int(torch.searchsorted(positions, float(n)))].long()  # (drops,) those below n


class _DropPositions(torch.autograd.Function):
    """x · scale with the elements at `positions` (of the flattened x) set to 0; the gradient
    likewise. One pass each way and only the positions saved, where x · mask would first write
    an n-element mask and save it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.scale = scale
        out = x.contiguous().mul(scale)  # a new contiguous tensor, so its flat view is x's element order
        out.view(-1).index_fill_(0, positions, 0.0)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        grad_x = grad.contiguous().mul(ctx.scale)
        grad_x.view(-1).index_fill_(0, positions, 0.0)
        return grad_x, None, None


def fast_dropout_applies(x: torch.Tensor, p: float) -> bool:
    """Whether `drop_positions` serves dropout of rate p on x: on a CPU, outside torch.compile."""
    return x.device.type == "cpu" and 0.0 < p < 1.0 and not torch.compiler.is_compiling()


def drop_positions(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of rate p (training) on a CPU tensor x, drawn by `dropped_positions`."""
    return _DropPositions.apply(x, dropped_positions(x.numel(), p), 1.0 / (1.0 - p))


def attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                           causal: bool, p: float) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + mask), dropout of rate p on it, then ·v: q (B, H, Tq, Dh), k, v (B, H, Tk, Dh),
    key_mask (B, Tk) bool or None -> (B, H, Tq, Dh).

    What `F.scaled_dot_product_attention` computes with `dropout_p=p`, written out for training
    on a CPU, where SDPA's math path draws its dropout with `bernoulli_` (see `drop_positions`).
    """
    B, H, Tq, Dh = q.shape
    Tk = k.shape[2]
    bias = q.new_zeros(1, 1, 1)  # additive mask: 0 = may attend, -inf = may not
    if key_mask is not None:
        bias = q.new_zeros(B, 1, 1, Tk).masked_fill_(~key_mask[:, None, None, :], float("-inf"))
        bias = bias.expand(B, H, 1, Tk).reshape(B * H, 1, Tk)  # (B·H, 1, Tk)
    if causal:
        bias = bias + q.new_full((Tq, Tk), float("-inf")).triu_(1)  # query i sees keys 0..i
    scores = torch.baddbmm(bias, q.reshape(B * H, Tq, Dh), k.reshape(B * H, Tk, Dh).transpose(1, 2),
                           alpha=1.0 / math.sqrt(Dh))  # (B·H, Tq, Tk)
    probs = drop_positions(scores.softmax(dim=-1), p)
    return torch.bmm(probs, v.reshape(B * H, Tk, Dh)).view(B, H, Tq, Dh)
