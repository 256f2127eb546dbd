"""Greedy decoding on top of `Transformer.encode` / `Transformer.decode`."""

from __future__ import annotations

import torch

from transformer_mt.model import Transformer


def max_target_lengths(src_mask: torch.Tensor, max_len_a: float, max_len_b: int, model_max_len: int) -> torch.Tensor:
    """Per-sentence cap on generated tokens (EOS included): a·S + b, within the model's positions.

    src_mask (B, S) bool -> (B,) long. The decoder input holds BOS plus all but the last
    generated token, so at most `model_max_len` tokens can be generated.
    """
    src_lengths = src_mask.sum(dim=1).float()  # (B,)
    limits = (max_len_a * src_lengths + max_len_b).floor().long()
    return limits.clamp(min=1, max=model_max_len)


@torch.no_grad()
def greedy_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int,
                  max_len_a: float, max_len_b: int) -> list[list[int]]:
    """Pick the most probable token at each step for a batch of sources.

    src_ids (B, S) long, padded with `model.pad_id` -> B lists of generated ids, without BOS
    and EOS. Each sentence stops at its EOS or its length cap; the batch stops when all have.
    This re-runs the decoder over the whole prefix at every step (no cache).
    """
    pad_id = model.pad_id
    src_mask = src_ids != pad_id  # (B, S) True = real token
    memory = model.encode(src_ids, src_mask)  # (B, S, D)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
    B = src_ids.shape[0]
    tgt_ids = torch.full((B, 1), bos_id, dtype=torch.long, device=src_ids.device)  # (B, 1)
    finished = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
    for step in range(int(limits.max())):
        logits = model.decode(tgt_ids, memory, src_mask)[:, -1, :]  # (B, V) last position only
        logits[:, pad_id] = torch.finfo(logits.dtype).min  # never generate padding or a second BOS
        logits[:, bos_id] = torch.finfo(logits.dtype).min
        next_ids = logits.argmax(dim=-1)  # (B,)
        next_ids = torch.where(finished, torch.full_like(next_ids, pad_id), next_ids)
        tgt_ids = torch.cat([tgt_ids, next_ids[:, None]], dim=1)  # (B, step + 2)
        finished |= (next_ids == eos_id) | (step + 1 >= limits)
        if bool(finished.all()):
            break
    return [_strip(row, eos_id, pad_id) for row in tgt_ids[:, 1:].tolist()]


def _strip(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Generated ids up to (not including) the first EOS or padding."""
    for i, token in enumerate(ids):
        if token in (eos_id, pad_id):
            return ids[:i]
    return ids
