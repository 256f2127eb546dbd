"""The encoder-decoder Transformer (Vaswani et al. 2017), written for clarity.

Masks are boolean and mean **True = may attend / real token**, the convention of
`F.scaled_dot_product_attention`. The model knows nothing of tokenizers or data: vocabulary
sizes and `pad_id` come in as arguments. Shapes: B batch, S source length, T target length,
D d_model, H heads, Dh head dim, V vocabulary. Device-specific speed paths that reuse these
parameters live beside the model, in `cpu_fast_path.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import ModelConfig
from transformer_mt.kv_cache import KVCache, LayerCache


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """Fixed sinusoidal position encodings (Vaswani et al. §3.5), shape (length, D), fp32."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class UninitializedLinear(nn.Linear):
    """An `nn.Linear` whose constructor draws nothing: `Transformer._init_weights` draws it, so
    building a model consumes the random stream once. (`nn.utils.skip_init` does the same through
    the meta device, whose first use imports sympy: half a second of every `tmt translate`.)"""

    def reset_parameters(self) -> None:
        pass


def linear(in_features: int, out_features: int, blocks: int = 1) -> nn.Linear:
    """An `nn.Linear` left uninitialised (`Transformer._init_weights` draws it); `blocks` > 1
    marks a fused layer, several projections of one input stacked along the output rows."""
    layer = UninitializedLinear(in_features, out_features)
    layer.blocks = blocks
    return layer


def init_linear(layer: nn.Linear) -> None:
    """Xavier-uniform weight, drawn per block so that a fused layer starts like separate ones
    (the bound depends on the fan-in plus fan-out of one projection); zero bias.

    Each block is drawn as its (in, out) transpose and copied in: the same numbers for a seed
    as tmt 0.1, whose weights were stored (in, out), so seeded runs train as they did.
    """
    with torch.no_grad():
        for block in layer.weight.chunk(layer.blocks, dim=0):  # (out / blocks, in) each
            block.copy_(nn.init.xavier_uniform_(block.new_empty(block.shape[1], block.shape[0])).t())  # (in, out / blocks)
        nn.init.zeros_(layer.bias)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over H heads, computed by `F.scaled_dot_product_attention`.

    Subclasses project queries, keys and values, then register `out_proj` (D, D) last.
    """

    out_proj: nn.Linear

    def __init__(self, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout

    def split_heads(self, x: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, ...]:
        """x (B, L, parts·D), e.g. fused projections -> `parts` tensors (B, H, L, Dh)."""
        B, L, PD = x.shape
        heads = x.view(B, L, parts, self.n_heads, PD // (parts * self.n_heads))  # (B, L, parts, H, Dh)
        return tuple(t.transpose(1, 2) for t in heads.unbind(2))  # (B, H, L, Dh) each

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """q (B, H, Tq, Dh) over k, v (B, H, Tk, Dh); key_mask (B, Tk) bool or None -> (B, Tq, D).

        `causal=True` lets query i see keys 0..i only; it assumes Tq == Tk.
        """
        B, H, Tq, Dh = q.shape
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0)  # (B, H, Tq, Dh)
        return self.out_proj(out.transpose(1, 2).reshape(B, Tq, H * Dh))  # (B, Tq, D)


class SelfAttention(MultiHeadAttention):
    """Attention of a sequence over itself; one (3D, D) projection gives queries, keys and values."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__(n_heads, dropout)
        self.qkv_proj = linear(d_model, 3 * d_model, blocks=3)  # rows: q, k, v
        self.out_proj = linear(d_model, d_model)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, L, D) -> queries, keys and values, each (B, H, L, Dh)."""
        return self.split_heads(self.qkv_proj(x), 3)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """x (B, L, D) attends over itself; key_mask (B, L) bool or None -> (B, L, D)."""
        return self.attend(*self.project(x), key_mask, causal)


class CrossAttention(MultiHeadAttention):
    """Attention of target positions over the encoder memory; one (2D, D) projection gives keys and values."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__(n_heads, dropout)
        self.q_proj = linear(d_model, d_model)
        self.kv_proj = linear(d_model, 2 * d_model, blocks=2)  # rows: k, v
        self.out_proj = linear(d_model, d_model)

    def project_kv(self, key_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """key_value (B, Tk, D) -> keys and values, each (B, H, Tk, Dh)."""
        return self.split_heads(self.kv_proj(key_value), 2)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """query (B, Tq, D) attends over key_value (B, Tk, D) -> (B, Tq, D)."""
        (q,) = self.split_heads(self.q_proj(query))
        return self.attend(q, *self.project_kv(key_value), key_mask)

    def attention_weights(self, query: torch.Tensor, key_value: torch.Tensor,
                          key_mask: torch.Tensor | None) -> torch.Tensor:
        """The probabilities `forward` attends with, (B, H, Tq, Tk), for inspection and plots.

        SDPA never materialises them, so this recomputes softmax(q·kᵀ/√Dh) from the same projections.
        """
        (q,) = self.split_heads(self.q_proj(query))  # (B, H, Tq, Dh)
        k, _ = self.project_kv(key_value)  # (B, H, Tk, Dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        return scores.float().softmax(dim=-1)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> ReLU -> dropout -> Linear."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1 = linear(d_model, d_ff)
        self.linear2 = linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

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
        self.dropout = nn.Dropout(dropout)
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

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """x (B, S, D) -> (B, S, D)."""
        x = self.attn_block(x, lambda h: self.self_attn(h, src_mask))
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
                cache: LayerCache | None = None) -> torch.Tensor:
        """y (B, T, D) -> (B, T, D). With a cache, y holds only the positions not yet cached."""
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
        return self.self_attn.attend(q, k, v, None, causal=cached == 0 and h.shape[1] > 1)

    def _cross_attention(self, h: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                         cache: LayerCache | None) -> torch.Tensor:
        if cache is None:
            return self.cross_attn(h, memory, src_mask)
        if cache.cross_k is None:
            cache.cross_k, cache.cross_v = self.cross_attn.project_kv(memory)
        (q,) = self.cross_attn.split_heads(self.cross_attn.q_proj(h))  # (B, H, n, Dh)
        return self.cross_attn.attend(q, cache.cross_k, cache.cross_v, src_mask)


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
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-norm stacks end with a LayerNorm, otherwise the last residual sum is unnormalised.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.output_proj = UninitializedLinear(cfg.d_model, tgt_vocab_size, bias=False)  # (V, D)
        self._init_weights()
        if cfg.tie_output:
            self.output_proj.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for module in self.modules():  # Xavier-uniform matrices, zero biases
            if isinstance(module, nn.Linear) and module is not self.output_proj:
                init_linear(module)
        nn.init.xavier_uniform_(self.output_proj.weight)  # replaced by the embedding when tied
        # With embeddings scaled by sqrt(D), N(0, D^-1/2) keeps embedding outputs at unit scale.
        for embed in dict.fromkeys([self.src_embed, self.tgt_embed]):  # once each, in a fixed order
            nn.init.normal_(embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()

    def check_length(self, length: int) -> None:
        """Refuse sequences longer than the position table."""
        if length > self.positions.shape[0]:
            raise ValueError(f"sequence of {length} tokens exceeds model.max_len={self.positions.shape[0]}")

    def embed(self, embedding: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """ids (B, L) -> (B, L, D): scaled token embedding plus the encodings of positions offset.., then dropout."""
        L = ids.shape[1]
        self.check_length(offset + L)
        x = embedding(ids) * self.embed_scale + self.positions[offset:offset + L].to(embedding.weight.dtype)
        return self.embed_dropout(x)

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) long, src_mask (B, S) bool -> memory (B, S, D)."""
        x = self.embed(self.src_embed, src_ids)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
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
        y = self.embed(self.tgt_embed, tgt_ids, offset)
        for i, layer in enumerate(self.decoder_layers):
            y = layer(y, memory, src_mask, None if cache is None else cache.layers[i])
        y = self.decoder_norm(y)
        if not fp32_logits:
            return self.output_proj(y)
        # Decoding ranks tokens by these logits: fp32 even under bf16/fp16 autocast, whose 8 or 11
        # mantissa bits would tie or swap close candidates. A step projects only (B, T) rows.
        with torch.autocast(device_type=y.device.type, enabled=False):
            return self.output_proj(y.float())

    def decode_best(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                    cache: KVCache | None = None, forbidden_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """Greedy decoding's step: `decode`, then each row's most probable next token that is not one
        of `forbidden_ids`, the first among ties -> (B,) long. A decoding copy may find it without
        computing every logit (`cpu_decoding.ArgmaxScreen`)."""
        logits = self.decode(tgt_ids, memory, src_mask, cache)[:, -1, :]  # (B, V)
        for token in forbidden_ids:  # column by column: no index tensor to copy to the device
            logits[:, token] = torch.finfo(logits.dtype).min
        return logits.max(dim=-1).indices

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for incremental decoding of up to `capacity` target positions."""
        return KVCache(len(self.decoder_layers), capacity)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) for src_ids (B, S) and tgt_in_ids (B, T): bf16 under bf16
        autocast (for a loss, which computes in fp32 itself), else fp32."""
        src_mask = src_ids != self.pad_id  # (B, S) True = real token
        # bf16 logits are fine for a loss that takes them to fp32 itself; fp16's narrow range
        # would overflow the projection's weight gradient at loss scales GradScaler uses.
        device_type = src_ids.device.type
        fp16 = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16
        return self.decode(tgt_in_ids, self.encode(src_ids, src_mask), src_mask, fp32_logits=fp16)

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

    def train_flops(self, src_lengths: Sequence[int] | np.ndarray, tgt_lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of one training step (forward + backward) over real tokens, padding excluded.

        `src_lengths` / `tgt_lengths`: tokens per sentence including EOS (source) and BOS/EOS
        (target), one entry per sentence. With D = d_model, F = d_ff, Le and Ld the encoder's and
        the decoder's layers, V = target vocabulary, S and T a sentence's source and target
        lengths, and the usual "6 × parameters × tokens" for a matmul's forward (2) and backward
        (4) multiply-adds:

        - encoder layers, per source token: 6 · Le · (4D² + 2DF)  (q, k, v, out projections; FFN)
        - decoder layers, per target token: 6 · Ld · (4D² + 2D² + 2DF)  (self-attention q, k, v, out;
          cross-attention q and out; FFN)
        - cross-attention keys and values, per source token: 6 · Ld · 2D²  (each decoder layer
          projects the memory)
        - output projection, per target token: 6 · D · V
        - attention scores and weighted sums, per sentence: 12 · D · (Le·S² + Ld·(T² + T·S))
          (QKᵀ and AV, 2 FLOPs per multiply-add each, ×3 for the backward; the causal decoder is
          counted as the full T² square, as PaLM's MFU does)

        Embedding lookups, LayerNorms, softmax and the loss are left out (they are not matmuls).
        """
        D, F, V = self.cfg.d_model, self.cfg.d_ff, self.output_proj.weight.shape[0]
        Le, Ld = len(self.encoder_layers), len(self.decoder_layers)
        S = np.asarray(src_lengths, dtype=np.float64)
        T = np.asarray(tgt_lengths, dtype=np.float64)
        src_tokens, tgt_tokens = S.sum(), T.sum()
        encoder = 6 * Le * (4 * D * D + 2 * D * F) * src_tokens
        decoder = 6 * Ld * (6 * D * D + 2 * D * F) * tgt_tokens
        cross_kv = 6 * Ld * 2 * D * D * src_tokens
        output = 6 * D * V * tgt_tokens
        attention = 12 * D * float(Le * (S * S).sum() + Ld * ((T * T).sum() + (T * S).sum()))
        return float(encoder + decoder + cross_kv + output + attention)
