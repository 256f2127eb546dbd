"""Training throughput accounting: model FLOPs per batch, device peak FLOP/s, MFU, padding efficiency."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from transformer_mt.config import ModelConfig

# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, FLOP/s. bf16 and fp16 are equal
# on these parts; fp32 matmuls run as TF32 only when torch allows it, so fp32 counts the TF32 peak.
PEAK_FLOPS = {
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 418e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
}


def train_flops(cfg: ModelConfig, tgt_vocab_size: int, src_lengths: Sequence[int] | np.ndarray,
                tgt_lengths: Sequence[int] | np.ndarray) -> float:
    """Model FLOPs of one training step (forward + backward) over real tokens, padding excluded.

    `src_lengths` / `tgt_lengths`: tokens per sentence including EOS (source) and BOS/EOS
    (target), one entry per sentence. With D = d_model, F = d_ff, L = n_layers (each side),
    V = target vocabulary, S and T a sentence's source and target lengths, and the usual
    "6 × parameters × tokens" for a matmul's forward (2) and backward (4) multiply-adds:

    - encoder layers, per source token: 6 · L · (4D² + 2DF)  (q, k, v, out projections; FFN)
    - decoder layers, per target token: 6 · L · (4D² + 2D² + 2DF)  (self-attention q, k, v, out;
      cross-attention q and out; FFN)
    - cross-attention keys and values, per source token: 6 · L · 2D²  (they project the memory)
    - output projection, per target token: 6 · D · V
    - attention scores and weighted sums, per sentence: 12 · L · D · (S² + T² + T·S)
      (QKᵀ and AV, 2 FLOPs per multiply-add each, ×3 for the backward; the causal decoder is
      counted as the full T² square, as PaLM's MFU does)

    Embedding lookups, LayerNorms, softmax and the loss are left out (they are not matmuls).
    """
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, tgt_vocab_size
    S = np.asarray(src_lengths, dtype=np.float64)
    T = np.asarray(tgt_lengths, dtype=np.float64)
    src_tokens, tgt_tokens = S.sum(), T.sum()
    encoder = 6 * L * (4 * D * D + 2 * D * F) * src_tokens
    decoder = 6 * L * (6 * D * D + 2 * D * F) * tgt_tokens
    cross_kv = 6 * L * 2 * D * D * src_tokens
    output = 6 * D * V * tgt_tokens
    attention = 12 * L * D * float((S * S).sum() + (T * T).sum() + (T * S).sum())
    return float(encoder + decoder + cross_kv + output + attention)


def peak_flops_per_s(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for `precision` ('bf16', 'fp16', 'fp32'); None when unknown or not a GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H100 SXM" before a bare "H100"
        if all(part in name for part in key.split()):
            return PEAK_FLOPS[key][precision]
    if "H100" in name:  # e.g. "NVIDIA H100 80GB HBM3" is the SXM part
        return PEAK_FLOPS["H100 SXM"][precision]
    return None


def padding_efficiency(real_tokens: int, padded_slots: int) -> float:
    """Real tokens ÷ padded slots (1.0 = no padding)."""
    return real_tokens / padded_slots if padded_slots else 1.0
