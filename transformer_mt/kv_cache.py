"""The decoder's key/value cache for incremental decoding: `KVCache`, one `LayerCache` per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    """One decoder layer's cached keys and values, each (B, H, L, Dh).

    Self-attention K/V live in one buffer `kv` (2, B, H, capacity, Dh) allocated on the first
    step and written in place, so a step copies only its new position (growing them with
    `torch.cat` would copy the whole prefix every step), with one copy when the caller has the
    keys and values side by side (`append_self_kv`). A reorder that keeps the row count gathers
    into a second buffer of the same shape and swaps the two: one copy, not a gather and a copy back.
    """

    capacity: int
    length: int = 0  # positions written so far
    kv: torch.Tensor | None = None  # (2, B, H, capacity, Dh): keys, then values
    spare: torch.Tensor | None = None  # kv's shape: where the next same-size reorder gathers into
    cross_k: torch.Tensor | None = None  # (B, H, S, Dh), computed once from the encoder memory
    cross_v: torch.Tensor | None = None

    @property
    def self_k(self) -> torch.Tensor | None:
        """(B, H, capacity, Dh), of which the first `length` positions are written."""
        return None if self.kv is None else self.kv[0]

    @property
    def self_v(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[1]

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' keys/values (B, H, n, Dh); return views of all written so far."""
        slot = self._slot(k, k.shape)
        slot[0] = k
        slot[1] = v
        return self._written()

    def append_self_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`append_self` of keys and values given as one tensor (2, B, H, n, Dh) (any strides): one copy."""
        self._slot(kv, kv.shape[1:]).copy_(kv)
        return self._written()

    def append_position(self, kv: torch.Tensor, rows: int) -> torch.Tensor:
        """Write one new position's keys and values, kv (2, B·H, Dh) (any strides), B = `rows`, in one
        copy; return all written so far as one view (2, B·H, length, Dh): fewer view operations per
        decoding step than `append_self_kv` (the buffer is contiguous: made here or by `reorder`)."""
        _, BH, Dh = kv.shape
        self._reserve(kv, (rows, BH // rows, 1, Dh))
        flat = self.kv.view(2, BH, self.capacity, Dh)
        flat[:, :, self.length - 1].copy_(kv)
        return flat[:, :, :self.length]

    def _slot(self, like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The buffer's view (2, B, H, n, Dh) for n new positions of `shape` (B, H, n, Dh) (of `like`'s
        dtype and device); counts them written."""
        self._reserve(like, shape)
        return self.kv[:, :, :, self.length - shape[2]:self.length]

    def _reserve(self, like: torch.Tensor, shape: tuple[int, int, int, int]) -> None:
        """Count n new positions of `shape` (B, H, n, Dh) written, making the buffer on the first."""
        B, H, n, Dh = shape
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {n} positions exceed its capacity {self.capacity}")
        if self.kv is None:
            self.kv = like.new_empty(2, B, H, self.capacity, Dh)
        self.length += n

    def _written(self) -> tuple[torch.Tensor, torch.Tensor]:
        written = self.kv[:, :, :, :self.length]
        return written[0], written[1]  # (B, H, length, Dh) each

    def reorder(self, indices: torch.Tensor, cross: bool) -> None:
        """Keep batch rows `indices` (long, (B',)) in that order; see `KVCache.reorder`."""
        if self.kv is not None:
            n = self.length
            if indices.shape[0] == self.kv.shape[1]:  # same rows: gather the written part into the spare buffer
                if self.spare is None:
                    self.spare = torch.empty_like(self.kv)
                torch.index_select(self.kv[:, :, :, :n], 1, indices, out=self.spare[:, :, :, :n])
                self.kv, self.spare = self.spare, self.kv
            else:
                self.kv, self.spare = self.kv.index_select(1, indices), None
        if cross and self.cross_k is not None:
            self.cross_k = self.cross_k.index_select(0, indices)
            self.cross_v = self.cross_v.index_select(0, indices)


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
        a row of the same source sentence (beams of one sentence share the same K/V) with the
        row count unchanged, or when they hold one row per sentence, which `select_cross`
        selects. The identity at the same row count with `cross=False` copies nothing.
        """
        first = self.layers[0]
        if (not cross and first.kv is not None and indices.shape[0] == first.kv.shape[1]
                and bool((indices == torch.arange(indices.shape[0], device=indices.device)).all())):
            return
        for layer in self.layers:
            layer.reorder(indices, cross)

    def select_cross(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (long) of the cross-attention K/V alone: where they hold one row per
        sentence for all its beams (`CpuDecodingTransformer.shares_source_rows`)."""
        for layer in self.layers:
            if layer.cross_k is not None:
                layer.cross_k, layer.cross_v = layer.cross_k.index_select(0, indices), layer.cross_v.index_select(0, indices)
