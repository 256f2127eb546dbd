"""The encoder-decoder Transformer (Vaswani et al. 2017), written for clarity.

Masks are boolean and mean **True = may attend / real token**, the convention of
`F.scaled_dot_product_attention`. The model knows nothing of tokenizers or data: vocabulary
sizes and `pad_id` come in as arguments. Shapes: B batch, S source length, T target length,
D d_model, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import ModelConfig


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """Fixed sinusoidal position encodings (Vaswani et al. §3.5), shape (length, D), fp32."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over H heads, computed by `F.scaled_dot_product_attention`."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, query: torch.Tensor, key_value: torch.Tensor, key_mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        """query (B, Tq, D), key_value (B, Tk, D), key_mask (B, Tk) bool or None -> (B, Tq, D).

        `causal=True` lets query i see keys 0..i only; it assumes Tq == Tk.
        """
        B, Tq, D = query.shape
        Tk = key_value.shape[1]
        H = self.n_heads
        q = self.q_proj(query).view(B, Tq, H, D // H).transpose(1, 2)  # (B, H, Tq, Dh)
        k = self.k_proj(key_value).view(B, Tk, H, D // H).transpose(1, 2)  # (B, H, Tk, Dh)
        v = self.v_proj(key_value).view(B, Tk, H, D // H).transpose(1, 2)  # (B, H, Tk, Dh)
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, H, Tq, Dh)
        out = out.transpose(1, 2).reshape(B, Tq, D)  # (B, Tq, D)
        return self.out_proj(out)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> ReLU -> dropout -> Linear."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(x))))


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
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.attn_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.ffn_block = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, h, src_mask))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.self_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.cross_block = Residual(cfg.d_model, cfg.dropout, pre)
        self.ffn_block = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, y: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        # Target padding sits at the end, so with a causal mask a real position never sees a
        # pad; pad positions compute garbage that the loss ignores. That lets SDPA use its
        # `is_causal` fast path with no explicit target mask.
        y = self.self_block(y, lambda h: self.self_attn(h, h, None, causal=True))
        y = self.cross_block(y, lambda h: self.cross_attn(h, memory, src_mask))
        return self.ffn_block(y, self.ffn)


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
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # Pre-norm stacks end with a LayerNorm, otherwise the last residual sum is unnormalised.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.output_proj = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_output:
            self.output_proj.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for name, param in self.named_parameters():
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        # With embeddings scaled by sqrt(D), N(0, D^-1/2) keeps embedding outputs at unit scale.
        for embed in {self.src_embed, self.tgt_embed}:
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

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) long, src_mask (B, S) bool -> memory (B, S, D)."""
        x = self._embed(self.src_embed, src_ids)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(self, tgt_ids: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """tgt_ids (B, T) long (starting with BOS), memory (B, S, D), src_mask (B, S) -> logits (B, T, V)."""
        y = self._embed(self.tgt_embed, tgt_ids)
        for layer in self.decoder_layers:
            y = layer(y, memory, src_mask)
        return self.output_proj(self.decoder_norm(y))

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) for src_ids (B, S) and tgt_in_ids (B, T)."""
        src_mask = src_ids != self.pad_id  # (B, S) True = real token
        return self.decode(tgt_in_ids, self.encode(src_ids, src_mask), src_mask)

    def num_parameters(self) -> int:
        """Trainable parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())
