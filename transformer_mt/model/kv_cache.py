"""The decoder's key/value cache: preallocated for the whole length cap and written by position
index, so every step has the same shapes (a CUDA graph can replay it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """Keys and values of past decoding steps for R rows, each sentence's rows neighbours."""

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
