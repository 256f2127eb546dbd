"""Attention pictures: a heat map of cross-attention with the tokens on both axes (matplotlib).

Uses `matplotlib.figure.Figure` directly, not pyplot, so nothing needs a display or a
global backend, and figures are freed with their last reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure


def attention_figure(weights: torch.Tensor, src_tokens: list[str], tgt_tokens: list[str], title: str) -> Figure:
    """weights (T, S): row t is where the decoder looked while producing `tgt_tokens[t]`."""
    T, S = weights.shape
    if (T, S) != (len(tgt_tokens), len(src_tokens)):
        raise ValueError(f"weights are {T}x{S} but there are {len(tgt_tokens)} target and {len(src_tokens)} source tokens")
    cell = 0.32  # inches per token, so labels stay readable
    figure = Figure(figsize=(max(4.0, 1.6 + cell * S), max(3.0, 1.2 + cell * T)), dpi=100, layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(weights.float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    axes.set_xticks(range(S), src_tokens, rotation=90, fontsize=8)
    axes.set_yticks(range(T), tgt_tokens, fontsize=8)
    axes.set_xlabel("source")
    axes.set_ylabel("target")
    axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, fraction=0.04)
    return figure


def image_formats() -> list[str]:
    """File suffixes (without the dot) that matplotlib writes: png, jpg, pdf, svg, ... (jpg and webp
    through Pillow, a dependency of matplotlib)."""
    return sorted(Figure().canvas.get_supported_filetypes())


def save_attention(path: Path, weights: torch.Tensor, src_tokens: list[str], tgt_tokens: list[str],
                   title: str) -> None:
    """Draw the attention map into `path`, in the format its suffix names (`image_formats`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    attention_figure(weights, src_tokens, tgt_tokens, title).savefig(path, format=path.suffix[1:].lower())
