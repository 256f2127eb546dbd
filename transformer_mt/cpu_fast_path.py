"""CPU speed paths of training beside the paper model, reusing its parameters: training on real
positions only (`Packing`, `real_positions_states`), dropout drawn by its gaps, the loss fused with
the output projection. (Decoding's CPU path is `cpu_decoding.py`.)

Each computes what the plain `Transformer` path computes (tests/test_model.py and
tests/test_training_speed.py check it); docs/benchmarks.md measures what each saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.dropout import attention_with_dropout, drop_positions, fast_dropout_applies
from transformer_mt.model import (CrossAttention, DecoderLayer, EncoderLayer, FeedForward, MultiHeadAttention,
                                  Residual, SelfAttention, Transformer)


# --- training on the real positions only ---------------------------------------------------------

@dataclass(frozen=True)
class Packing:
    """The real (non-pad) tokens of a right-padded (B, L) batch, as rows of the flattened batch.

    Training can run every position-wise layer (projections, FFN, LayerNorm, dropout, the output
    projection) on these N rows only, and skip the pads. Attention `pad`s its projected rows
    back to (B, L, ·) with zeros at the pads: the key mask keeps them out of source attention,
    and the causal mask out of target self-attention (target pads come last); the rows at the
    pads are then dropped again by `pack`. Every real position computes what it would padded.
    """

    index: torch.Tensor  # (N,) long: b·L + l of each real token, in row-major order
    pad_index: torch.Tensor  # (B·L - N,) long: the other positions, the pads
    batch: int  # B
    length: int  # L

    @classmethod
    def of(cls, real: torch.Tensor) -> Packing:
        """real (B, L) bool, True = real token -> the packing of its True positions."""
        flat = real.flatten()  # (B·L,)
        return cls(flat.nonzero().squeeze(1), (~flat).nonzero().squeeze(1), real.shape[0], real.shape[1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, L, ...) -> its real rows (N, ...)."""
        return x.flatten(0, 1).index_select(0, self.index)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (N, C) -> (B, L, C), zeros at the pads."""
        padded = rows.new_empty(self.batch * self.length, rows.shape[-1])  # (B·L, C)
        padded.index_fill_(0, self.pad_index, 0.0)  # zero only the pad rows (a pad row of garbage could be NaN)
        padded.index_copy_(0, self.index, rows)  # in place: the out-of-place form would copy the buffer first
        return padded.view(self.batch, self.length, -1)  # (B, L, C)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`nn.Dropout(p)` in distribution; on a CPU drawn through the gaps between drops
    (`dropout.drop_positions`), which made `bernoulli_` 18% of a CPU training step less."""
    if not training or p == 0.0:
        return x
    if not fast_dropout_applies(x, p):
        return F.dropout(x, p, training=True)
    return drop_positions(x, p)


def _attend(attention: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            key_mask: torch.Tensor | None, causal: bool, packing: Packing) -> torch.Tensor:
    """`MultiHeadAttention.attend` for the queries' real rows: q (B, H, Tq, Dh) over k, v (B, H, Tk, Dh)
    -> (N, D). In training on a CPU its dropout is drawn by gaps (`attention_with_dropout`)."""
    B, H, Tq, Dh = q.shape
    if attention.training and fast_dropout_applies(q, attention.dropout):
        out = attention_with_dropout(q, k, v, key_mask, causal, attention.dropout)  # (B, H, Tq, Dh)
    else:
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                             dropout_p=attention.dropout if attention.training else 0.0)
    out = out.transpose(1, 2).reshape(B, Tq, H * Dh)  # (B, Tq, D)
    return attention.out_proj(packing.pack(out))  # (N, D)


def _self_attention(attention: SelfAttention, x: torch.Tensor, packing: Packing, key_mask: torch.Tensor | None,
                    causal: bool) -> torch.Tensor:
    """Real rows x (N, D) attend over themselves -> (N, D)."""
    q, k, v = attention.split_heads(packing.pad(attention.qkv_proj(x)), 3)  # (B, H, L, Dh) each
    return _attend(attention, q, k, v, key_mask, causal, packing)


def _cross_attention(attention: CrossAttention, y: torch.Tensor, memory: torch.Tensor,
                     packings: tuple[Packing, Packing], src_mask: torch.Tensor) -> torch.Tensor:
    """Target rows y (Nt, D) attend over memory rows (Ns, D) -> (Nt, D)."""
    src, tgt = packings
    k, v = attention.split_heads(src.pad(attention.kv_proj(memory)), 2)  # (B, H, S, Dh) each
    (q,) = attention.split_heads(tgt.pad(attention.q_proj(y)))  # (B, H, T, Dh)
    return _attend(attention, q, k, v, src_mask, False, tgt)


def _residual(block: Residual, x: torch.Tensor, sublayer) -> torch.Tensor:
    """`Residual.forward` with its dropout drawn by gaps."""
    p = block.dropout.p
    if block.pre_norm:
        return x + dropout(sublayer(block.norm(x)), p, block.training)
    return block.norm(x + dropout(sublayer(x), p, block.training))


def _ffn(ffn: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """`FeedForward.forward` with its dropout drawn by gaps."""
    return ffn.linear2(dropout(F.relu(ffn.linear1(x)), ffn.dropout.p, ffn.training))


def _encoder_layer(layer: EncoderLayer, x: torch.Tensor, src_mask: torch.Tensor, packing: Packing) -> torch.Tensor:
    x = _residual(layer.attn_block, x, lambda h: _self_attention(layer.self_attn, h, packing, src_mask, False))
    return _residual(layer.ffn_block, x, lambda h: _ffn(layer.ffn, h))


def _decoder_layer(layer: DecoderLayer, y: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                   packings: tuple[Packing, Packing]) -> torch.Tensor:
    # Target pads come last: under the causal mask no real position sees one, so no key mask.
    y = _residual(layer.self_block, y, lambda h: _self_attention(layer.self_attn, h, packings[1], None, True))
    y = _residual(layer.cross_block, y, lambda h: _cross_attention(layer.cross_attn, h, memory, packings, src_mask))
    return _residual(layer.ffn_block, y, lambda h: _ffn(layer.ffn, h))


def _embed_rows(model: Transformer, embedding: nn.Embedding, ids: torch.Tensor, packing: Packing) -> torch.Tensor:
    """ids (B, L) -> the real rows (N, D) of `Transformer.embed`'s output."""
    model.check_length(packing.length)
    token = embedding(ids.flatten().index_select(0, packing.index))  # (N, D)
    position = model.positions.index_select(0, packing.index % packing.length)  # (N, D)
    x = token * model.embed_scale + position.to(embedding.weight.dtype)
    return dropout(x, model.embed_dropout.p, model.training)


def real_positions_states(model: Transformer, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's final states at the real (non-pad) target positions, (N, D) in row-major order,
    i.e. aligned with `tgt_out_ids[tgt_out_ids != pad_id]`; `model.output_proj` of them are those
    positions' logits of `model(src_ids, tgt_in_ids)`.

    Every layer computes only at real source and target positions (`Packing`), which gives the
    same values there and skips the padding's share of the work; the output projection is left
    to the caller, so a loss can fuse it with the softmax and never hold all (N, V) logits.
    """
    src_mask = src_ids != model.pad_id  # (B, S) True = real token
    packings = Packing.of(src_mask), Packing.of(tgt_in_ids != model.pad_id)  # source, target
    x = _embed_rows(model, model.src_embed, src_ids, packings[0])  # (Ns, D)
    for layer in model.encoder_layers:
        x = _encoder_layer(layer, x, src_mask, packings[0])
    memory = model.encoder_norm(x)  # (Ns, D)
    y = _embed_rows(model, model.tgt_embed, tgt_in_ids, packings[1])  # (Nt, D)
    for layer in model.decoder_layers:
        y = _decoder_layer(layer, y, memory, src_mask, packings)
    return model.decoder_norm(y)  # (Nt, D)


# --- the loss fused with the output projection ---------------------------------------------------

def projected_label_smoothed_loss(states: torch.Tensor, output_weight: torch.Tensor, target_ids: torch.Tensor,
                                  pad_id: int, epsilon: float, product_dtype: torch.dtype | None = None
                                  ) -> torch.Tensor:
    """`loss.label_smoothed_loss` of the logits states·Wᵀ, computed a block of rows at a time,
    never all at once: states (N, D), output_weight W (V, D), target_ids (N,) -> fp32 scalar sum.

    `product_dtype` (bf16 under bf16 autocast) is the dtype of the projection's matrix products,
    as autocast would run it inside the model; the logits, the softmax and the loss are fp32
    whatever it is.
    """
    return _ProjectedLabelSmoothedNLL.apply(states.float(), output_weight.float(), target_ids.flatten(),
                                            pad_id, epsilon, product_dtype or torch.float32)


class _ProjectedLabelSmoothedNLL(torch.autograd.Function):
    """Label-smoothed NLL of the logits z = h·Wᵀ, fused with the projection, by blocks of rows.

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


def real_positions_loss(model: Transformer, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor,
                        tgt_out_ids: torch.Tensor, label_smoothing: float,
                        product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The summed label-smoothed loss of a batch (fp32 scalar), computed on the real positions only
    and fused with the output projection: the plain path's loss and gradients (tests/test_training_speed.py).

    The states follow the caller's autocast; the loss runs outside it, its products in `product_dtype`.
    """
    states = real_positions_states(model, src_ids, tgt_in_ids)  # (N, D)
    targets = tgt_out_ids[tgt_out_ids != model.pad_id]  # (N,)
    with torch.autocast(device_type=src_ids.device.type, enabled=False):
        return projected_label_smoothed_loss(states, model.output_proj.weight, targets, model.pad_id,
                                             label_smoothing, product_dtype)
