"""The decoder's key/value cache for incremental decoding: `KVCache`, one `LayerCache` per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    """One decoder layer's cached keys and values, each (B, H, L, Dh).

    Self-attention K/V live in one buffer `kv` (2, B, H, span, Dh), a view of the flat `store`
    that has room for `capacity` positions; made on the first step with span = capacity and
    written in place, so a step copies only its new position (growing them with `torch.cat`
    would copy the whole prefix every step), with one copy when the caller has the keys and
    values side by side (`append_self_kv`). At span = capacity the store is position-major,
    (2, capacity, B, H, Dh) in memory: a step's new position is one contiguous block, and
    attention reads each (row, head) as runs of Dh at a stride BLAS takes as a leading dimension
    (CPU greedy at batch 32: 0.96x the time of the block layout, (2, B, H, capacity, Dh) in
    memory, whose writes touch B·H separate runs; docs/benchmarks.md).

    A reorder that keeps the row count (beam search: every step) gathers the written positions
    into a second store and swaps the two: one copy, not a gather and a copy back. It lays them
    out block by block with span = written + 1, the room for the next step's position, so that
    the gather and the next step's attention read contiguous rows; at span = capacity they read
    each head's positions as short runs strided over the whole buffer (CPU, beam 4 at batch 32:
    the gathers took 1.35x and the attention products 2.4x as long, the whole search 1.13x;
    docs/benchmarks.md). A write past the span first moves the written positions back to span =
    capacity, position-major.
    """

    capacity: int
    length: int = 0  # positions written so far
    kv: torch.Tensor | None = None  # (2, B, H, span, Dh), in `store` (`_laid_out`): keys, then values
    store: torch.Tensor | None = None  # flat, 2·B·H·capacity·Dh elements
    spare: torch.Tensor | None = None  # `store`'s size: where the next same-size reorder gathers into
    cross_k: torch.Tensor | None = None  # (B, H, S, Dh), computed once from the encoder memory
    cross_v: torch.Tensor | None = None

    @property
    def self_k(self) -> torch.Tensor | None:
        """(B, H, span, Dh), of which the first `length` positions are written."""
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
        decoding step than `append_self_kv`."""
        _, BH, Dh = kv.shape
        self._reserve(kv, (rows, BH // rows, 1, Dh))
        flat = self.kv.view(2, BH, self.kv.shape[3], Dh)
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
            self.store = like.new_empty(2 * B * H * self.capacity * Dh)
            self.kv = self._laid_out(self.store, B, H, self.capacity, Dh)
        elif self.length + n > self.kv.shape[3]:  # past a reorder's span: the written part to span = capacity
            self._move(None, self.capacity)
        self.length += n

    def _move(self, indices: torch.Tensor | None, span: int) -> None:
        """Lay the written positions of rows `indices` (all rows: None) out at `span` in the spare
        store (same rows) or a new one, which becomes `store`."""
        _, B, H, _, Dh = self.kv.shape
        rows = B if indices is None else indices.shape[0]
        same_rows = rows == B  # else the old stores are the wrong size
        reuse = self.spare if same_rows else None
        target = reuse if reuse is not None else self.kv.new_empty(2 * rows * H * self.capacity * Dh)
        moved = self._laid_out(target, rows, H, span, Dh)
        n, written = self.length, self.kv[:, :, :, :self.length]
        if indices is None:
            moved[:, :, :, :n].copy_(written)
        else:
            torch.index_select(written, 1, indices, out=moved[:, :, :, :n])
        self.kv, self.store, self.spare = moved, target, (self.store if same_rows else None)

    def _laid_out(self, store: torch.Tensor, B: int, H: int, span: int, Dh: int) -> torch.Tensor:
        """The buffer (2, B, H, span, Dh) in `store`: position-major, (2, span, B, H, Dh) in memory, at
        span = capacity; else block by block, (2, B, H, span, Dh) in memory."""
        if span == self.capacity:
            return store.view(2, span, B, H, Dh).permute(0, 2, 3, 1, 4)
        return store[:2 * B * H * span * Dh].view(2, B, H, span, Dh)

    def _written(self) -> tuple[torch.Tensor, torch.Tensor]:
        written = self.kv[:, :, :, :self.length]
        return written[0], written[1]  # (B, H, length, Dh) each

    def reorder(self, indices: torch.Tensor, cross: bool) -> None:
        """Keep batch rows `indices` (long, (B',)) in that order; see `KVCache.reorder`."""
        if self.kv is not None:
            same_rows = indices.shape[0] == self.kv.shape[1]
            # Same rows: beam search, which writes one position before its next reorder. Fewer
            # rows: sentences dropped; greedy decoding writes every later position in place.
            self._move(indices, min(self.length + 1, self.capacity) if same_rows else self.capacity)
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
