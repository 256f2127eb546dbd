"""The encoder-decoder Transformer (Vaswani et al. 2017): one forward pass for training, validation and
translation, and the key/value cache of its incremental decoding. Masks: True = may attend / real token.
Shapes: B batch, S source, T target, L either length, N rows, D d_model, H heads, Dh head dim, V vocabulary."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config.schema import ModelConfig


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """Fixed sinusoidal position encodings (Vaswani et al. §3.5), shape (length, D), fp32."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class _UniqueRows(torch.autograd.Function):
    """x (M, ...) -> its rows at `index` (N,), distinct indices. The gradient goes back by a copy:
    `index_select`'s backward sums into a zeroed tensor (`index_add_`) in case an index repeats,
    which on a CPU is a scalar scatter several times slower than the copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.n_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.n_rows, *grad.shape[1:]).index_copy_(0, index, grad), None


@dataclass(frozen=True)
class Packing:
    """Which positions of a right-padded (B, L) batch are the model's rows, in row-major order:
    the real tokens (`of`, no compute on padding) or every position (`dense`, fixed shapes); or the
    N rows of a pack, sentences laid end to end (`packed`, B = 1: attention within each segment)."""

    mask: torch.Tensor  # (B, L) bool, True = real token
    index: torch.Tensor | None  # (N,) long: b·L + l of each row; None: every position is a row
    offsets: torch.Tensor | None = None  # packed: (P+1,) int32 start of each segment, then N
    longest: int = 0  # packed: no segment is longer

    @classmethod
    def of(cls, mask: torch.Tensor) -> Packing:
        """The real tokens of mask (B, L) as rows."""
        return cls(mask, mask.flatten().nonzero().squeeze(1))

    @classmethod
    def dense(cls, mask: torch.Tensor) -> Packing:
        """Every position of mask (B, L) as a row."""
        return cls(mask, None)

    @classmethod
    def packed(cls, offsets: torch.Tensor, n_rows: int, longest: int) -> Packing:
        """The `n_rows` rows of a pack whose segments start at `offsets` (P+1,) int32."""
        return cls(torch.ones(1, n_rows, dtype=torch.bool, device=offsets.device), None, offsets, longest)

    @property
    def length(self) -> int:
        """The longest sentence the rows may hold (what the position table must cover)."""
        return self.longest if self.offsets is not None else self.mask.shape[1]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, L, ...) -> its rows (N, ...)."""
        flat = x.flatten(0, 1)
        return flat if self.index is None else _UniqueRows.apply(flat, self.index)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (N, C) -> (B, L, C), zeros at the positions that are not rows."""
        B, L = self.mask.shape
        if self.index is None:
            return rows.view(B, L, -1)
        return rows.new_zeros(B * L, rows.shape[-1]).index_copy_(0, self.index, rows).view(B, L, -1)

    def segment_of_rows(self) -> torch.Tensor:
        """Packed: (N,) long, the segment of each row (empty segments hold none)."""
        rows = torch.arange(self.mask.shape[1], device=self.mask.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets, rows, right=True) - 1

    def positions(self) -> torch.Tensor:
        """(N,) long: each row's position in its sentence."""
        B, L = self.mask.shape
        if self.offsets is not None:
            rows = torch.arange(L, device=self.mask.device)
            return rows - self.offsets.long().index_select(0, self.segment_of_rows())
        if self.index is None:
            return torch.arange(L, device=self.mask.device).repeat(B)
        return self.index % L


def _reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pack: Packing, k_pack: Packing,
                      causal: bool, dropout: float) -> torch.Tensor:
    """Segment-wise attention through SDPA on any device: q (Nq, H, Dh), k, v (Nk, H, Dh) laid out
    as (P, longest) padded sentences, attended, and gathered back -> (Nq, H, Dh)."""
    L = max(q_pack.longest, k_pack.longest)
    slots = torch.arange(L, device=q.device)

    def padded(x: torch.Tensor, pack: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H, Dh) -> (P, H, L, Dh) and (P, L) bool, True = a row of the segment."""
        starts, ends = pack.offsets[:-1].long(), pack.offsets[1:].long()  # (P,)
        at = starts[:, None] + slots  # (P, L)
        return x.index_select(0, at.clamp(max=x.shape[0] - 1).flatten()).unflatten(0, at.shape).transpose(1, 2), \
            at < ends[:, None]

    (qp, _), (kp, key_mask), (vp, _) = padded(q, q_pack), padded(k, k_pack), padded(v, k_pack)
    # Query rows past their segment's end (never gathered back) and empty segments still see key 0:
    # no row attends over nothing, so no NaN reaches the backward.
    key_mask = key_mask | (slots == 0)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=None if causal else key_mask[:, None, None, :],
                                         is_causal=causal, dropout_p=dropout)  # (P, H, L, Dh)
    at = q_pack.segment_of_rows() * L + q_pack.positions()  # (Nq,) each row's place in (P, L)
    return _UniqueRows.apply(out.transpose(1, 2).flatten(0, 1), at)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pack: Packing, k_pack: Packing,
                  causal: bool, dropout: float) -> torch.Tensor:
    """Segment-wise attention through FlashAttention's variable-length kernel (CUDA; no dropout)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), q_pack.offsets, k_pack.offsets,
                       q_pack.longest, k_pack.longest, window_size=(-1, 0) if causal else (-1, -1))


def varlen_backend(device: torch.device, dropout: float, dtype: torch.dtype = torch.bfloat16):
    """The attention of packed rows of `dtype` on `device`: FlashAttention's variable-length kernel
    on CUDA in fp16 or bf16 (it has no dropout: attention dropout takes the reference), else the SDPA reference."""
    if device.type == "cuda" and dropout == 0.0 and dtype in (torch.float16, torch.bfloat16) and varlen_available():
        return _flash_varlen
    return _reference_varlen


@functools.cache  # asked at every packed attention call on CUDA
def varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen.varlen_attn`."""
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@dataclass
class LayerCache:
    """One decoder layer's view of the cache for one step. R rows, H heads, C capacity, S source length."""

    self_k: torch.Tensor  # (R, H, C, Dh)
    self_v: torch.Tensor  # (R, H, C, Dh)
    cross_k: torch.Tensor  # (R, H, S, Dh), projected from the encoder memory once
    cross_v: torch.Tensor  # (R, H, S, Dh)
    position: torch.Tensor  # (1,) long: the position this step writes
    key_mask: torch.Tensor  # (1, C) bool: the positions written so far, this one included

    def write_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new position's k, v (R, H, 1, Dh); return all keys, values (R, H, C, Dh), the key mask."""
        self.self_k.index_copy_(2, self.position, k)
        self.self_v.index_copy_(2, self.position, v)
        return self.self_k, self.self_v, self.key_mask


@dataclass
class KVCache:
    """Keys and values of past decoding steps for R rows (a sentence's rows neighbours), preallocated
    for the length cap and written by position index: every step has the same shapes (a CUDA graph)."""

    self_kv: torch.Tensor  # (layers, 2, R, H, C, Dh): self-attention keys, then values
    cross_k: list[torch.Tensor]  # per layer (R, H, S, Dh)
    cross_v: list[torch.Tensor]
    src_mask: torch.Tensor  # (R, S) bool, True = real source token
    new_positions: torch.Tensor  # (R, 1) bool, all True: one new position per row and step
    position: torch.Tensor  # (1,) long: the target position the next step writes
    slots: torch.Tensor  # (1, C) long: 0 .. C - 1

    @classmethod
    def start(cls, cross: list[tuple[torch.Tensor, torch.Tensor]], src_mask: torch.Tensor, capacity: int,
              rows_per_sentence: int = 1) -> KVCache:
        """An empty cache from each layer's cross-attention keys and values (B, H, S, Dh) and
        src_mask (B, S), each sentence repeated `rows_per_sentence` times."""
        n = rows_per_sentence
        cross_k = [k.repeat_interleave(n, dim=0) for k, _ in cross]
        cross_v = [v.repeat_interleave(n, dim=0) for _, v in cross]
        R, H, _, Dh = cross_k[0].shape
        device = src_mask.device
        return cls(cross_k[0].new_zeros(len(cross), 2, R, H, capacity, Dh), cross_k, cross_v,
                   src_mask.repeat_interleave(n, dim=0), torch.ones(R, 1, dtype=torch.bool, device=device),
                   torch.zeros(1, dtype=torch.long, device=device), torch.arange(capacity, device=device)[None, :])

    def layers(self) -> list[LayerCache]:
        """Each decoder layer's view for this step, sharing one key mask."""
        key_mask = self.slots <= self.position
        return [LayerCache(kv[0], kv[1], k, v, self.position, key_mask)
                for kv, k, v in zip(self.self_kv, self.cross_k, self.cross_v)]

    def reorder(self, rows: torch.Tensor, written: int | None = None) -> None:
        """Row r takes the self-attention keys and values of row rows[r] (R,) long, in place, at the
        first `written` positions (None: all C, for fixed shapes); the source side stays."""
        kv = self.self_kv[..., :written, :]
        kv.copy_(kv.index_select(2, rows))

    def select(self, rows: torch.Tensor, written: int | None = None) -> KVCache:
        """A cache of rows `rows` (R',) long alone, at the same position (`written` as in `reorder`)."""
        self_kv = self.self_kv.new_zeros(*self.self_kv.shape[:2], len(rows), *self.self_kv.shape[3:])
        self_kv[..., :written, :] = self.self_kv[..., :written, :].index_select(2, rows)
        return KVCache(self_kv, [k.index_select(0, rows) for k in self.cross_k],
                       [v.index_select(0, rows) for v in self.cross_v], self.src_mask.index_select(0, rows),
                       self.new_positions[:len(rows)], self.position, self.slots)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over H heads (§3.2.2); subclasses project its inputs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout

    def split_heads(self, x: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, ...]:
        """x (B, L, parts·D), e.g. fused projections -> `parts` tensors (B, H, L, Dh)."""
        B, L, PD = x.shape
        heads = x.view(B, L, parts, self.n_heads, PD // (parts * self.n_heads))  # (B, L, parts, H, Dh)
        return tuple(t.transpose(1, 2) for t in heads.unbind(2))  # (B, H, L, Dh) each

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
               causal: bool = False, packs: tuple[Packing, Packing] | None = None) -> torch.Tensor:
        """softmax(q·kᵀ/√Dh)·v: q (B, H, Tq, Dh) over k, v (B, H, Tk, Dh) -> (B, Tq, H·Dh); key_mask
        (B or 1, Tk) bool or None; `causal`: query i sees keys 0..i. Packed queries and keys (`packs`,
        B = 1) attend within their segments, through `varlen_backend`. The one attention of the model."""
        B, H, Tq, Dh = q.shape
        dropout = self.dropout if self.training else 0.0
        if packs is not None and packs[0].offsets is not None:
            rows = [x[0].transpose(0, 1) for x in (q, k, v)]  # (N, H, Dh) each
            out = varlen_backend(q.device, dropout, q.dtype)(*rows, *packs, causal, dropout)  # (Nq, H, Dh)
            return out.reshape(1, Tq, H * Dh)
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, dropout_p=dropout)
        return out.transpose(1, 2).reshape(B, Tq, H * Dh)


class SelfAttention(MultiHeadAttention):
    """Attention of a sequence over itself; one (3D, D) projection gives queries, keys and values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.qkv_proj = linear(cfg.d_model, 3 * cfg.d_model, blocks=3)  # rows: q, k, v
        self.out_proj = linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, packing: Packing, causal: bool = False,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Rows x (N, D) attend over their sentences -> (N, D); with a cache, one new position per
        sentence, written into it, attends over every position written so far."""
        q, k, v = self.split_heads(packing.pad(self.qkv_proj(x)), 3)  # (B, H, L, Dh) each
        # Target padding sits at the end: under the causal mask no real query sees a pad.
        key_mask = None if causal else packing.mask
        if cache is not None:
            k, v, key_mask = cache.write_self(k, v)  # (B, H, C, Dh), (B, H, C, Dh), (1, C)
            causal = False
        return self.out_proj(packing.rows(self.attend(q, k, v, key_mask, causal, (packing, packing))))


class CrossAttention(MultiHeadAttention):
    """Attention of target positions over the encoder memory; one (2D, D) projection gives keys and values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.q_proj = linear(cfg.d_model, cfg.d_model)
        self.kv_proj = linear(cfg.d_model, 2 * cfg.d_model, blocks=2)  # rows: k, v
        self.out_proj = linear(cfg.d_model, cfg.d_model)

    def keys_values(self, memory: torch.Tensor, src: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory rows (Ns, D) -> keys and values (B, H, S, Dh) each."""
        return self.split_heads(src.pad(self.kv_proj(memory)), 2)

    def forward(self, y: torch.Tensor, memory: torch.Tensor | None, tgt: Packing, src: Packing,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Target rows y (Nt, D) attend over memory rows (Ns, D), or the cache's keys and values -> (Nt, D)."""
        (q,) = self.split_heads(tgt.pad(self.q_proj(y)))  # (B, H, T, Dh)
        k, v = self.keys_values(memory, src) if cache is None else (cache.cross_k, cache.cross_v)
        return self.out_proj(tgt.rows(self.attend(q, k, v, src.mask, packs=(tgt, src))))

    def attention_weights(self, y: torch.Tensor, memory: torch.Tensor, tgt: Packing, src: Packing,
                          cache: LayerCache | None = None) -> torch.Tensor:
        """The probabilities `forward` attends with, (B, H, T, S), for plots (SDPA never makes them)."""
        (q,) = self.split_heads(tgt.pad(self.q_proj(y)))  # (B, H, T, Dh)
        k, _ = self.keys_values(memory, src)  # (B, H, S, Dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
        scores = scores.masked_fill(~src.mask[:, None, None, :], float("-inf"))
        return scores.float().softmax(dim=-1)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}  # `model.activation` -> its function


class FeedForward(nn.Module):
    """Position-wise feed-forward network (§3.3): Linear -> activation -> dropout -> Linear."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear1 = linear(cfg.d_model, cfg.d_ff)
        self.linear2 = linear(cfg.d_ff, cfg.d_model)
        self.activation = ACTIVATIONS[cfg.activation]
        self.dropout = nn.Dropout(cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class Residual(nn.Module):
    """A sublayer wrapped with dropout, the residual sum and LayerNorm (pre- or post-norm, §5.4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.norm == "pre"

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention over the source, then the feed-forward network (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.ffn = SelfAttention(cfg), FeedForward(cfg)
        self.attn_block, self.ffn_block = Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, src: Packing) -> torch.Tensor:
        """Source rows x (Ns, D) -> (Ns, D)."""
        x = self.attn_block(x, lambda h: self.self_attn(h, src))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, then the FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = SelfAttention(cfg), CrossAttention(cfg), FeedForward(cfg)
        self.self_block, self.cross_block, self.ffn_block = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(self, y: torch.Tensor, memory: torch.Tensor | None, tgt: Packing, src: Packing,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Target rows y (Nt, D) -> (Nt, D); with a cache, one new position per sentence."""
        y = self.self_block(y, lambda h: self.self_attn(h, tgt, causal=True, cache=cache))
        y = self.cross_block(y, lambda h: self.cross_attn(h, memory, tgt, src, cache))
        return self.ffn_block(y, self.ffn)


def linear(in_features: int, out_features: int, blocks: int = 1) -> nn.Linear:
    """An `nn.Linear`; `blocks` > 1 marks a fused layer, several projections of one input stacked
    along the output rows, which `Transformer` initialises block by block."""
    layer = nn.Linear(in_features, out_features)
    layer.blocks = blocks
    return layer


class Transformer(nn.Module):
    """Encoder-decoder Transformer with (scaled) embeddings and sinusoidal positions."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int):
        super().__init__()
        if cfg.share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError("share_embeddings needs equal source and target vocabulary sizes")
        self.cfg = cfg
        self.pad_id = pad_id
        self.src_embed = nn.Embedding(src_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(
            tgt_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0  # §3.4: multiplied by sqrt(D)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-norm stacks end with a LayerNorm, otherwise the last residual sum is unnormalised.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.output_proj = nn.Linear(cfg.d_model, tgt_vocab_size, bias=cfg.output_bias)  # (V, D), bias (V,)
        self._init_weights()
        if cfg.tie_output:
            self.output_proj.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        # Xavier-uniform per block of a fused projection; zero biases; embeddings N(0, D^-1/2).
        for module in self.modules():
            if isinstance(module, nn.Linear):
                for block in module.weight.data.chunk(getattr(module, "blocks", 1), dim=0):
                    nn.init.xavier_uniform_(block)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for embed in dict.fromkeys([self.src_embed, self.tgt_embed]):  # once each, in a fixed order
            nn.init.normal_(embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()

    def check_length(self, length: int) -> None:
        """Refuse sequences longer than the position table."""
        if length > self.positions.shape[0]:
            raise ValueError(f"sequence of {length} tokens exceeds model.max_len={self.positions.shape[0]}")

    def embed(self, embedding: nn.Embedding, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids (N,) at positions (N,) -> scaled embeddings plus position encodings, then dropout (N, D)."""
        x = embedding(ids) * self.embed_scale + self.positions.index_select(0, positions).to(embedding.weight.dtype)
        return self.embed_dropout(x)

    def encode(self, src_ids: torch.Tensor, src: Packing) -> torch.Tensor:
        """src_ids (B, S) long -> memory rows (Ns, D) of the packing `src`."""
        self.check_length(src.length)
        x = self.embed(self.src_embed, src.rows(src_ids), src.positions())
        for layer in self.encoder_layers:
            x = layer(x, src)
        return self.encoder_norm(x)

    def decode(self, tgt_ids: torch.Tensor, tgt: Packing, memory: torch.Tensor, src: Packing) -> torch.Tensor:
        """Teacher forcing: tgt_ids (B, T) long (BOS first) over memory rows (Ns, D) -> final states (Nt, D)."""
        self.check_length(tgt.length)
        y = self.embed(self.tgt_embed, tgt.rows(tgt_ids), tgt.positions())
        for layer in self.decoder_layers:
            y = layer(y, memory, tgt, src)
        return self.decoder_norm(y)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, pack: bool = True,
                offsets: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """Teacher-forced logits of the target rows: src_ids (B, S), tgt_in_ids (B, T) -> (Nt, V)
        (`target_states`, then `project`)."""
        return self.project(self.target_states(src_ids, tgt_in_ids, pack, offsets))

    def target_states(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, pack: bool = True,
                      offsets: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """Teacher-forced final decoder states of the target rows: src_ids (B, S), tgt_in_ids (B, T) ->
        (Nt, D). `pack`: the rows are the real target tokens, else every position (Nt = B·T).
        `offsets`: a pack (B = 1), its source and target segment offsets (P+1,) int32 and longest
        segment; every position is a row."""
        if offsets is not None:
            src_offsets, tgt_offsets, longest = offsets
            src = Packing.packed(src_offsets, src_ids.shape[1], longest)
            tgt = Packing.packed(tgt_offsets, tgt_in_ids.shape[1], longest)
        else:
            packed = Packing.of if pack else Packing.dense
            src, tgt = packed(src_ids != self.pad_id), packed(tgt_in_ids != self.pad_id)
        return self.decode(tgt_in_ids, tgt, self.encode(src_ids, src), src)

    def output_operands(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The output layer's states (N, D), weight (V, D) and bias (V,) or None in the logits' dtype:
        autocast's, except fp32 under fp16 (the projection's weight gradient would overflow)."""
        device_type = states.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else states.dtype
        dtype = torch.float32 if dtype == torch.float16 else dtype
        bias = self.output_proj.bias
        return states.to(dtype), self.output_proj.weight.to(dtype), None if bias is None else bias.to(dtype)

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """Final states (N, D) -> logits (N, V) in the dtype of `output_operands`."""
        operands = self.output_operands(states)
        with torch.autocast(device_type=states.device.type, enabled=False):
            return F.linear(*operands)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Decoder states (N, D) -> fp32 logits (N, V), even under autocast (bf16 would tie close tokens)."""
        with torch.autocast(device_type=states.device.type, enabled=False):
            return self.output_proj(states.float())

    def new_cache(self, src_ids: torch.Tensor, capacity: int, rows_per_sentence: int = 1) -> KVCache:
        """Encode src_ids (B, S) (no host sync) into a cache for up to `capacity` target positions,
        with `rows_per_sentence` neighbouring rows per sentence (beams or samples)."""
        self.check_length(capacity)
        src = Packing.dense(src_ids != self.pad_id)
        memory = self.encode(src_ids, src)  # (B·S, D)
        cross = [layer.cross_attn.keys_values(memory, src) for layer in self.decoder_layers]  # (B, H, S, Dh) each
        return KVCache.start(cross, src.mask, capacity, rows_per_sentence)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Input tokens (R,) long at `cache.position` -> fp32 logits (R, V) of the next token;
        writes that position's keys and values."""
        y = self.embed(self.tgt_embed, tokens, cache.position.expand(tokens.shape[0]))  # (R, D)
        tgt, src = Packing.dense(cache.new_positions), Packing.dense(cache.src_mask)  # one position per row
        for layer, layer_cache in zip(self.decoder_layers, cache.layers()):
            y = layer(y, None, tgt, src, layer_cache)
        return self.logits(self.decoder_norm(y))

    @torch.no_grad()
    def cross_attention(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, layer: int = -1) -> torch.Tensor:
        """Cross-attention probabilities of decoder layer `layer` under teacher forcing, (B, H, T, S):
        row t is where the decoder looks when predicting target token t."""
        captured = []
        attention = self.decoder_layers[layer].cross_attn
        hook = attention.register_forward_hook(
            lambda module, args, output: captured.append(module.attention_weights(*args)))
        try:
            self(src_ids, tgt_in_ids, pack=False)
        finally:
            hook.remove()
        return captured[0]

    def freeze(self, prefixes: tuple[str, ...]) -> int:
        """Stop training the parameters whose state-dict names start with one of `prefixes`
        (`config.schema.frozen_prefixes`); a tied weight is frozen under any of its names. Returns
        the parameters frozen, tied weights counted once."""
        for name, param in self.named_parameters(remove_duplicate=False):
            if name.startswith(prefixes):
                param.requires_grad_(False)
        return sum(p.numel() for p in self.parameters() if not p.requires_grad)

    def num_parameters(self) -> int:
        """Trainable parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())

    def train_flops(self, src_lengths: Sequence[int] | np.ndarray, tgt_lengths: Sequence[int] | np.ndarray) -> float:
        """Matmul FLOPs of one training step (forward + backward, 6 per parameter and token) over
        sentences of these lengths (with EOS; BOS/EOS for targets), padding excluded. Attention
        counts the causal square whole, as PaLM's MFU does; embeddings, norms and softmax are left out."""
        D, F, V = self.cfg.d_model, self.cfg.d_ff, self.output_proj.weight.shape[0]
        Le, Ld = len(self.encoder_layers), len(self.decoder_layers)
        S, T = np.asarray(src_lengths, dtype=np.float64), np.asarray(tgt_lengths, dtype=np.float64)
        per_src = 6 * Le * (4 * D * D + 2 * D * F) + 6 * Ld * 2 * D * D  # encoder layers, cross k, v
        per_tgt = 6 * Ld * (6 * D * D + 2 * D * F) + 6 * D * V  # self q, k, v, out; cross q, out; FFN; output
        attention = 12 * D * float(Le * (S * S).sum() + Ld * ((T * T).sum() + (T * S).sum()))
        return float(per_src * S.sum() + per_tgt * T.sum() + attention)


def build_model(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int) -> Transformer:
    """A freshly initialised model of `cfg` (drawn from torch's default generator) for these vocabularies."""
    return Transformer(cfg, src_vocab_size, tgt_vocab_size, pad_id)
