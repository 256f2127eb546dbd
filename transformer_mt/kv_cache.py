"""The decoder's key/value cache for incremental decoding: `KVCache`, one `LayerCache` per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
