"""Cross-attention maps of the torch model, their token labels, and their pictures (matplotlib's
`Figure` directly, not pyplot: no display or global backend needed)."""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from transformer_mt.data.tokenization import model_source, token_room
from transformer_mt.decode.torch_engine import cross_attention_maps
from transformer_mt.model.transformer import Transformer


def cross_attention_map(model: Transformer, src_ids: list[int], hyp_ids: list[int], *, bos_id: int, eos_id: int,
                        device: torch.device, layer: int = -1) -> torch.Tensor:
    """Head-averaged cross-attention of decoder `layer` while producing `hyp_ids` + EOS from
    `src_ids` + EOS (teacher-forced on the hypothesis): (T + 1, S + 1), fp32 on the CPU."""
    return cross_attention_maps(model, [src_ids], [hyp_ids], layer, bos_id=bos_id, eos_id=eos_id, device=device)[0]


def cross_attention_labels(src_pieces: list[str], hyp_pieces: list[str], eos: str, max_len: int
                           ) -> tuple[list[str], list[str]]:
    """Axis labels of `cross_attention_map`: the source pieces and EOS, and the pieces each decoder
    position produced, then EOS; both cut as the map is (a hypothesis filling max_len has no EOS row)."""
    hyp_rows = min(len(hyp_pieces), token_room(max_len)) + 1
    return model_source(src_pieces, max_len, eos), (hyp_pieces + [eos])[:hyp_rows]


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
