"""The encoder-decoder Transformer (Vaswani et al. 2017), written for clarity.

Masks are boolean and mean **True = may attend / real token**, the convention of
`F.scaled_dot_product_attention`. The model knows nothing of tokenizers or data: vocabulary
sizes and `pad_id` come in as arguments. Shapes: B batch, S source length, T target length,
D d_model, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import ModelConfig
from transformer_mt.dropout import Dropout, attention_with_dropout, fast_dropout_applies


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """Fixed sinusoidal position encodings (Vaswani et al. §3.5), shape (length, D), fp32."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class Linear(nn.Module):
    """y = x·W + b with the matrix W stored (in, out), the transpose of `nn.Linear`'s (out, in).

    At the few rows of a decoding step (batch × 1 position), MKL's CPU GEMM multiplies by an
    (in, out) matrix 20–45% faster than by the transposed view `nn.Linear` uses; at training
    sizes the two are equally fast (docs/benchmarks.md, "Where tmt's time goes"). The matrix is
    named `kernel`, as in Keras and Flax, whose dense layers use this layout. A fused layer
    (`blocks` > 1) stacks several projections of the same input along the output dimension.
    """

    def __init__(self, in_features: int, out_features: int, blocks: int = 1):
        super().__init__()
        self.blocks = blocks
        self.kernel = nn.Parameter(torch.empty(in_features, out_features))  # (in, out)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.kernel)  # (N, out)
        return out.view(*x.shape[:-1], out.shape[-1])

    def reset_parameters(self) -> None:
        """Xavier-uniform matrix, drawn per block so that a fused layer starts like separate
        ones (its bound depends on the fan-in plus fan-out of one projection); zero bias."""
        for block in self.kernel.chunk(self.blocks, dim=1):  # (in, out / blocks) each
            nn.init.xavier_uniform_(block)
        nn.init.zeros_(self.bias)


# Checkpoints written before the projections were fused: per decoder/encoder sublayer, the
# separate (out, in) `nn.Linear` weights of each name below become one fused (in, out) kernel.
_FUSED = {"self_attn": ("qkv_proj", ["q_proj", "k_proj", "v_proj"]), "cross_attn": ("kv_proj", ["k_proj", "v_proj"])}
_NN_LINEAR = {"q_proj", "k_proj", "v_proj", "out_proj", "linear1", "linear2"}


def has_separate_projections(state: dict[str, torch.Tensor]) -> bool:
    """Whether a model state dict predates the fused projections and (in, out) kernels."""
    return any(key.endswith(".self_attn.q_proj.weight") for key in state)


def fused_parameter_name(key: str) -> str:
    """Today's name of a parameter saved before the fused projections, e.g.
    `decoder_layers.0.self_attn.k_proj.weight` -> `decoder_layers.0.self_attn.qkv_proj.kernel`."""
    module, _, name = key.rpartition(".")  # e.g. "decoder_layers.0.self_attn.k_proj", "weight"
    parent, _, layer = module.rpartition(".")
    sublayer = parent.rpartition(".")[2]
    if sublayer in _FUSED and layer in _FUSED[sublayer][1]:
        module = f"{parent}.{_FUSED[sublayer][0]}"
    if layer in _NN_LINEAR and name == "weight":
        name = "kernel"
    return f"{module}.{name}"


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert per-parameter tensors saved before the fused projections to today's names and layouts.

    Works on a model state dict and equally on per-parameter optimizer state (Adam's moments,
    which are elementwise, so converting them like the weights resumes exactly): `nn.Linear`
    `weight` (out, in) becomes `kernel` (in, out); self-attention q/k/v become `qkv_proj`,
    cross-attention k/v `kv_proj`, stacked in that order. Keys keep their order, a fused
    parameter taking the place of its first part; 0-dim tensors (a step count) are shared.
    """
    parts: dict[str, list[torch.Tensor]] = {}  # new key -> its old tensors in (out, in) layout
    for key, tensor in state.items():
        parts.setdefault(fused_parameter_name(key), []).append(tensor)
    converted = {}
    for key, tensors in parts.items():
        tensor = torch.cat(tensors) if tensors[0].dim() > 0 else tensors[0]
        converted[key] = tensor.t().contiguous() if key.endswith(".kernel") else tensor
    return converted


class OutputProjection(nn.Module):
    """Logits y·Wᵀ with W (V, D) stored like an embedding matrix, so it can be the target embedding (tied).

    For the few rows of a decoding step it computes (W·yᵀ)ᵀ instead, the same products in the
    orientation MKL's CPU GEMM runs 20–35% faster at those sizes (docs/benchmarks.md); the
    logits are then a transposed view. Larger inputs (training) keep the contiguous `F.linear`,
    whose output the loss reads row by row.
    """

    max_rows_transposed = 256  # decoding steps: batch (× beams) rows; a training batch has thousands

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))  # (V, D)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """y (..., D) -> logits (..., V)."""
        rows = y.reshape(-1, y.shape[-1])  # (N, D)
        if rows.shape[0] > self.max_rows_transposed:
            return F.linear(y, self.weight)
        return torch.mm(self.weight, rows.t()).t().view(*y.shape[:-1], -1)  # (V, N) -> (N, V) view -> (..., V)


@dataclass(frozen=True)
class Packing:
    """The real (non-pad) tokens of a right-padded (B, L) batch, as rows of the flattened batch.

    Training can run every position-wise layer (projections, FFN, LayerNorm, dropout, the output
    projection) on these N rows only, and skip the pads. Attention `pad`s its projected rows
    back to (B, L, ·) with zeros at the pads: the key mask keeps them out of source attention,
    and the causal mask out of target self-attention (target pads come last); the rows at the
    pads are then dropped again by `unpad`. Every real position computes what it would padded.
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


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over H heads, computed by `F.scaled_dot_product_attention`.

    Subclasses project queries, keys and values, then register `out_proj` (D, D) last, so that
    parameters keep the order they had as separate q, k, v, out layers (`fuse_projections`).
    """

    out_proj: Linear

    def __init__(self, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        return x.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, L, Dh)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                causal: bool, packing: Packing | None = None) -> torch.Tensor:
        """q (B, H, Tq, Dh) over k, v (B, H, Tk, Dh); key_mask (B, Tk) bool or None -> (B, Tq, D),
        or with the queries' `packing`, their real rows (N, D).

        `causal=True` lets query i see keys 0..i only; it assumes Tq == Tk.
        """
        B, H, Tq, Dh = q.shape
        if self.training and fast_dropout_applies(q, self.dropout):
            out = attention_with_dropout(q, k, v, key_mask, causal, self.dropout)  # (B, H, Tq, Dh)
        else:
            attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=causal,
                dropout_p=self.dropout if self.training else 0.0,
            )  # (B, H, Tq, Dh)
        out = out.transpose(1, 2).reshape(B, Tq, H * Dh)  # (B, Tq, D)
        return self.out_proj(out if packing is None else packing.pack(out))  # (B, Tq, D) or (N, D)


class SelfAttention(MultiHeadAttention):
    """Attention of a sequence over itself; one (D, 3D) projection gives queries, keys and values."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__(n_heads, dropout)
        self.qkv_proj = Linear(d_model, 3 * d_model, blocks=3)  # columns: q, k, v
        self.out_proj = Linear(d_model, d_model)

    def project(self, x: torch.Tensor,
                packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, L, D), or its real rows (N, D) with their `packing` -> queries, keys and values,
        each (B, H, L, Dh)."""
        qkv = self.qkv_proj(x)  # (B, L, 3D) or (N, 3D)
        if packing is not None:
            qkv = packing.pad(qkv)  # (B, L, 3D)
        B, L, D3 = qkv.shape
        q, k, v = qkv.view(B, L, 3, self.n_heads, D3 // (3 * self.n_heads)).unbind(2)  # (B, L, H, Dh) each
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, Dh) each

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, causal: bool = False,
                packing: Packing | None = None) -> torch.Tensor:
        """x (B, L, D) attends over itself; key_mask (B, L) bool or None -> (B, L, D).
        With `packing`, x and the result are the real rows (N, D)."""
        return self._attend(*self.project(x, packing), key_mask, causal, packing)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Projected q (B, H, Tq, Dh) over projected (e.g. cached) k, v (B, H, Tk, Dh) -> (B, Tq, D)."""
        return self._attend(q, k, v, None, causal)


class CrossAttention(MultiHeadAttention):
    """Attention of target positions over the encoder memory; one (D, 2D) projection gives keys and values."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__(n_heads, dropout)
        self.q_proj = Linear(d_model, d_model)
        self.kv_proj = Linear(d_model, 2 * d_model, blocks=2)  # columns: k, v
        self.out_proj = Linear(d_model, d_model)

    def project_kv(self, key_value: torch.Tensor, packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """key_value (B, Tk, D), or its real rows (N, D) with their `packing` -> keys and values,
        each (B, H, Tk, Dh)."""
        kv = self.kv_proj(key_value)  # (B, Tk, 2D) or (N, 2D)
        if packing is not None:
            kv = packing.pad(kv)  # (B, Tk, 2D)
        B, Tk, D2 = kv.shape
        k, v = kv.view(B, Tk, 2, self.n_heads, D2 // (2 * self.n_heads)).unbind(2)  # (B, Tk, H, Dh) each
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, H, Tk, Dh) each

    def attend(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: torch.Tensor | None, packing: Packing | None = None) -> torch.Tensor:
        """query (B, Tq, D) over projected k, v (B, H, Tk, Dh); key_mask (B, Tk) bool or None -> (B, Tq, D).
        With the queries' `packing`, query and the result are their real rows (N, D)."""
        q = self.q_proj(query)  # (B, Tq, D) or (N, D)
        if packing is not None:
            q = packing.pad(q)  # (B, Tq, D)
        return self._attend(self._split_heads(q), k, v, key_mask, False, packing)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """query (B, Tq, D) attends over key_value (B, Tk, D) -> (B, Tq, D)."""
        return self.attend(query, *self.project_kv(key_value), key_mask)

    def attention_weights(self, query: torch.Tensor, key_value: torch.Tensor,
                          key_mask: torch.Tensor | None) -> torch.Tensor:
        """The probabilities `forward` attends with, (B, H, Tq, Tk), for inspection and plots.

        SDPA never materialises them, so this recomputes softmax(q·kᵀ/√Dh) explicitly.
        """
        q = self._split_heads(self.q_proj(query))  # (B, H, Tq, Dh)
        k, _ = self.project_kv(key_value)  # (B, H, Tk, Dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        return scores.float().softmax(dim=-1)


@dataclass
class LayerCache:
    """One decoder layer's cached keys and values, each (B, H, L, Dh).

    Self-attention K/V live in buffers of `capacity` positions allocated on the first step and
    written in place, so a step copies only its new position (growing them with `torch.cat`
    would copy the whole prefix every step).
    """

    capacity: int
    length: int = 0  # positions written so far
    self_k: torch.Tensor | None = None  # (B, H, capacity, Dh) buffer
    self_v: torch.Tensor | None = None
    cross_k: torch.Tensor | None = None  # (B, H, S, Dh), computed once from the encoder memory
    cross_v: torch.Tensor | None = None

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' keys/values (B, H, n, Dh); return views of all written so far."""
        n = k.shape[2]
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {n} positions exceed its capacity {self.capacity}")
        if self.self_k is None:
            B, H, _, Dh = k.shape
            self.self_k = k.new_empty(B, H, self.capacity, Dh)
            self.self_v = v.new_empty(B, H, self.capacity, Dh)
        self.self_k[:, :, self.length:self.length + n] = k
        self.self_v[:, :, self.length:self.length + n] = v
        self.length += n
        return self.self_k[:, :, :self.length], self.self_v[:, :, :self.length]  # (B, H, length, Dh)


class KVCache:
    """Keys and values of past decoding steps, so each step runs the decoder on one new token.

    Self-attention K/V grow by one position per step (up to `capacity` positions);
    cross-attention K/V are computed from the memory on the first step. `reorder` selects
    batch rows: beam search keeps the surviving beams, and finished sentences can be dropped.
    """

    def __init__(self, n_layers: int, capacity: int):
        self.layers = [LayerCache(capacity) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Target positions already cached."""
        return self.layers[0].length

    def reorder(self, indices: torch.Tensor, *, cross: bool = True) -> None:
        """Keep batch rows `indices` (long, (B',)), in that order, in every cached tensor.

        `cross=False` leaves the cross-attention K/V alone: valid when each row is replaced by
        a row of the same source sentence (beams of one sentence share the same K/V), with the
        row count unchanged.
        """
        for layer in self.layers:
            if layer.self_k is not None:
                n = layer.length
                if indices.shape[0] == layer.self_k.shape[0]:  # same rows: gather the written part in place
                    layer.self_k[:, :, :n] = layer.self_k[:, :, :n].index_select(0, indices)
                    layer.self_v[:, :, :n] = layer.self_v[:, :, :n].index_select(0, indices)
                else:
                    layer.self_k = layer.self_k.index_select(0, indices)
                    layer.self_v = layer.self_v.index_select(0, indices)
            if cross and layer.cross_k is not None:
                layer.cross_k = layer.cross_k.index_select(0, indices)
                layer.cross_v = layer.cross_v.index_select(0, indices)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> ReLU -> dropout -> Linear."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1 = Linear(d_model, d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(x))))


def attention_dropout(cfg: ModelConfig) -> float:
    """Dropout on attention probabilities: `model.attention_dropout`, else `model.dropout`."""
    return cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout


def activation_dropout(cfg: ModelConfig) -> float:
    """Dropout on the FFN's hidden activations: `model.activation_dropout`, else `model.dropout`."""
    return cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout


class Residual(nn.Module):
    """A sublayer wrapped with dropout, the residual sum and LayerNorm (pre- or post-norm)."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention over the source, then the feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, attention_dropout(cfg))
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg))
        self.attn_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.ffn_block = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """x (B, S, D), or its real rows (N, D) with their `packing` -> the same shape."""
        x = self.attn_block(x, lambda h: self.self_attn(h, src_mask, packing=packing))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, attention_dropout(cfg))
        self.cross_attn = CrossAttention(cfg.d_model, cfg.n_heads, attention_dropout(cfg))
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg))
        self.self_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.cross_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.ffn_block = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, y: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                cache: LayerCache | None = None, packings: tuple[Packing, Packing] | None = None) -> torch.Tensor:
        """y (B, T, D) -> (B, T, D). With a cache, y holds only the positions not yet cached.
        With `packings` (source, target), y, memory and the result are their real rows."""
        if packings is not None:
            src, tgt = packings
            y = self.self_block(y, lambda h: self.self_attn(h, None, causal=True, packing=tgt))
            y = self.cross_block(y, lambda h: self.cross_attn.attend(
                h, *self.cross_attn.project_kv(memory, src), src_mask, packing=tgt))
            return self.ffn_block(y, self.ffn)
        y = self.self_block(y, lambda h: self._self_attention(h, cache))
        y = self.cross_block(y, lambda h: self._cross_attention(h, memory, src_mask, cache))
        return self.ffn_block(y, self.ffn)

    def _self_attention(self, h: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        # Target padding sits at the end, so with a causal mask a real position never sees a
        # pad; pad positions compute garbage that the loss ignores. That lets SDPA use its
        # `is_causal` fast path with no explicit target mask.
        if cache is None:
            return self.self_attn(h, None, causal=True)
        cached = cache.length
        if cached and h.shape[1] != 1:
            raise ValueError("with a non-empty cache, decode one position at a time")
        q, k, v = self.self_attn.project(h)  # (B, H, n, Dh) each
        k, v = cache.append_self(k, v)  # (B, H, cached + n, Dh) each
        # The first call may feed a whole prefix (causal); later a single query sees every key.
        return self.self_attn.attend(q, k, v, causal=cached == 0 and h.shape[1] > 1)

    def _cross_attention(self, h: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                         cache: LayerCache | None) -> torch.Tensor:
        if cache is None:
            return self.cross_attn(h, memory, src_mask)
        if cache.cross_k is None:
            cache.cross_k, cache.cross_v = self.cross_attn.project_kv(memory)
        return self.cross_attn.attend(h, cache.cross_k, cache.cross_v, src_mask)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with scaled embeddings and sinusoidal positions."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int):
        super().__init__()
        if cfg.share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError("share_embeddings needs equal source and target vocabulary sizes")
        self.cfg = cfg
        self.pad_id = pad_id
        self.src_embed = nn.Embedding(src_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(
            tgt_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.embed_scale = math.sqrt(cfg.d_model)  # §3.4: embeddings are multiplied by sqrt(D)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # Pre-norm stacks end with a LayerNorm, otherwise the last residual sum is unnormalised.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.output_proj = OutputProjection(cfg.d_model, tgt_vocab_size)
        self._init_weights()
        if cfg.tie_output:
            self.output_proj.weight = self.tgt_embed.weight
        self.register_load_state_dict_pre_hook(Transformer._load_separate_projections)

    @staticmethod
    def _load_separate_projections(module, state_dict: dict, prefix: str, *args) -> None:
        """`load_state_dict` accepts a state dict saved before the projections were fused."""
        if not prefix and has_separate_projections(state_dict):
            converted = fuse_projections(state_dict)
            state_dict.clear()
            state_dict.update(converted)

    def _init_weights(self) -> None:
        for module in self.modules():  # Xavier-uniform matrices, zero biases
            if isinstance(module, Linear):
                module.reset_parameters()
        nn.init.xavier_uniform_(self.output_proj.weight)  # replaced by the embedding when tied
        # With embeddings scaled by sqrt(D), N(0, D^-1/2) keeps embedding outputs at unit scale.
        for embed in dict.fromkeys([self.src_embed, self.tgt_embed]):  # once each, in a fixed order
            nn.init.normal_(embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()

    def _embed(self, embedding: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """ids (B, L) -> (B, L, D): scaled token embedding plus position encoding."""
        L = ids.shape[1]
        if offset + L > self.positions.shape[0]:
            raise ValueError(f"sequence of {offset + L} tokens exceeds model.max_len={self.positions.shape[0]}")
        x = embedding(ids) * self.embed_scale + self.positions[offset:offset + L].to(embedding.weight.dtype)
        return self.embed_dropout(x)

    def _embed_rows(self, embedding: nn.Embedding, ids: torch.Tensor, packing: Packing) -> torch.Tensor:
        """ids (B, L) -> the real rows (N, D) of `_embed`'s output."""
        if packing.length > self.positions.shape[0]:
            raise ValueError(f"sequence of {packing.length} tokens exceeds model.max_len={self.positions.shape[0]}")
        token = embedding(ids.flatten().index_select(0, packing.index))  # (N, D)
        position = self.positions.index_select(0, packing.index % packing.length)  # (N, D)
        return self.embed_dropout(token * self.embed_scale + position.to(embedding.weight.dtype))

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """src_ids (B, S) long, src_mask (B, S) bool -> memory (B, S, D); with the source
        `packing`, only its real rows (N, D)."""
        x = self._embed(self.src_embed, src_ids) if packing is None else self._embed_rows(
            self.src_embed, src_ids, packing)
        for layer in self.encoder_layers:
            x = layer(x, src_mask, packing)
        return self.encoder_norm(x)

    def decode(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: KVCache | None = None, fp32_logits: bool = True) -> torch.Tensor:
        """tgt_ids (B, T) long, memory (B, S, D), src_mask (B, S) bool -> logits (B, T, V), fp32
        unless `fp32_logits=False` lets autocast compute them in its dtype (training: the loss
        takes them to fp32 itself, and an fp32 projection under bf16 would be the step's slowest
        matrix product, at the fp32 rate).

        Without a cache, tgt_ids is the whole prefix starting with BOS. With a cache, it holds
        only the new positions (one per step after the first call), and the cache is updated.
        """
        offset = 0 if cache is None else cache.length
        y = self._embed(self.tgt_embed, tgt_ids, offset)
        for i, layer in enumerate(self.decoder_layers):
            y = layer(y, memory, src_mask, None if cache is None else cache.layers[i])
        y = self.decoder_norm(y)
        if not fp32_logits:
            return self.output_proj(y)
        # Decoding ranks tokens by these logits: fp32 even under bf16/fp16 autocast, whose 8 or 11
        # mantissa bits would tie or swap close candidates. A step projects only (B, T) rows.
        with torch.autocast(device_type=y.device.type, enabled=False):
            return self.output_proj(y.float())

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for incremental decoding of up to `capacity` target positions."""
        return KVCache(len(self.decoder_layers), capacity)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, real_states: bool = False) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) for src_ids (B, S) and tgt_in_ids (B, T): bf16 under bf16
        autocast (for a loss, which computes in fp32 itself), else fp32.

        `real_states=True` returns instead the decoder's final states at the real (non-pad)
        target positions, (N, D) in row-major order, i.e. aligned with
        `tgt_out_ids[tgt_out_ids != pad_id]`; `output_proj` of them are those positions'
        logits. Every layer then computes only at real source and target positions
        (`Packing`), which gives the same values there and skips the padding's share of the
        work; the output projection is left to the caller, so a loss can fuse it with the
        softmax and never hold all (N, V) logits (training on a CPU).
        """
        src_mask = src_ids != self.pad_id  # (B, S) True = real token
        if not real_states:
            # bf16 logits are fine for a loss that takes them to fp32 itself; fp16's narrow range
            # would overflow the projection's weight gradient at loss scales GradScaler uses.
            device_type = src_ids.device.type
            fp16 = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16
            return self.decode(tgt_in_ids, self.encode(src_ids, src_mask), src_mask, fp32_logits=fp16)
        packings = Packing.of(src_mask), Packing.of(tgt_in_ids != self.pad_id)  # source, target
        memory = self.encode(src_ids, src_mask, packings[0])  # (Ns, D)
        y = self._embed_rows(self.tgt_embed, tgt_in_ids, packings[1])  # (Nt, D)
        for layer in self.decoder_layers:
            y = layer(y, memory, src_mask, packings=packings)
        return self.decoder_norm(y)  # (Nt, D)

    @torch.no_grad()
    def cross_attention(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, layer: int = -1) -> torch.Tensor:
        """Cross-attention probabilities of decoder layer `layer` under teacher forcing, (B, H, T, S).

        Row t is where the decoder looks when predicting target token t (`tgt_in_ids` shifted).
        """
        captured = []
        attention = self.decoder_layers[layer].cross_attn
        hook = attention.register_forward_hook(
            lambda module, args, output: captured.append(module.attention_weights(*args[:3])))
        try:
            self(src_ids, tgt_in_ids)
        finally:
            hook.remove()
        return captured[0]

    def num_parameters(self) -> int:
        """Trainable parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())
