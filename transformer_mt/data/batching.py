"""Token ids -> padded or packed `Batch`es; a seeded, resumable sampler of length-bucketed
token-budget batches or of packs, sentences laid end to end (`TokenBatchSampler`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from transformer_mt.core.errors import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """One batch. Source ends with EOS; the target is shifted for teacher forcing. Padded: one
    sentence per row. Packed (`offsets` set): one row of sentences laid end to end, filler at the tail."""

    src_ids: torch.Tensor  # (B, S) long: tokens + EOS, then pad; packed (1, S): sentence after sentence
    tgt_in_ids: torch.Tensor  # (B, T) long: BOS + tokens, then pad
    tgt_out_ids: torch.Tensor  # (B, T) long: tokens + EOS, then pad
    n_src_tokens: int  # real (non-pad) source tokens
    n_tgt_tokens: int  # real target tokens predicted: the loss normaliser
    # Packed only: (P+1,) int32 start of each segment in the row, then the row's length; the
    # segments are the sentences, then filler of at most `longest` tokens each, then empty ones.
    src_offsets: torch.Tensor | None = None
    tgt_offsets: torch.Tensor | None = None
    longest: int = 0  # packed: no segment is longer (either side)

    @property
    def packed(self) -> bool:
        return self.src_offsets is not None

    def _map(self, fn) -> Batch:
        tensors = [fn(t) if t is not None else None for t in (self.src_ids, self.tgt_in_ids, self.tgt_out_ids,
                                                               self.src_offsets, self.tgt_offsets)]
        return Batch(*tensors[:3], self.n_src_tokens, self.n_tgt_tokens, *tensors[3:], self.longest)

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`; asynchronous from pinned memory (`pin_memory`) to a GPU."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory, so `to(cuda)` overlaps with the running step."""
        return self._map(lambda t: t.pin_memory())

    @property
    def padded_src_slots(self) -> int:
        return self.src_ids.numel()

    @property
    def padded_tgt_slots(self) -> int:
        return self.tgt_out_ids.numel()


def round_up(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple` (1: unchanged); also elementwise on arrays."""
    return -(-length // multiple) * multiple


def padded_length(length: int, multiple: int, max_length: int | None = None) -> int:
    """`length` rounded up to a multiple of `multiple`, capped at `max_length` (not below `length`); also on arrays."""
    rounded = round_up(length, multiple)
    return rounded if max_length is None else np.maximum(length, np.minimum(rounded, max_length))


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, pad_to_multiple: int = 1,
                  max_length: int | None = None) -> torch.Tensor:
    """Right-pad id lists to one (N, L) long tensor; L = the longest, padded by `padded_length`."""
    width = int(padded_length(max(len(s) for s in seqs), pad_to_multiple, max_length))
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def make_batch(src_seqs: Sequence[Sequence[int]], tgt_seqs: Sequence[Sequence[int]],
               pad_id: int, bos_id: int, eos_id: int, pad_to_multiple: int = 1, max_length: int | None = None
               ) -> Batch:
    """A `Batch` of token-id lists without special tokens, lengths padded by `padded_length`."""
    def flat(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        return np.fromiter(chain.from_iterable(seqs), dtype=np.int64), np.array([len(s) for s in seqs], dtype=np.int64)

    return make_batch_from_flat(*flat(src_seqs), *flat(tgt_seqs), pad_id, bos_id, eos_id, pad_to_multiple, max_length)


def _place_rows(values: np.ndarray, lengths: np.ndarray, width: int, pad_id: int, start: int) -> np.ndarray:
    """(B, width) int64 of pad_id with row i's `lengths[i]` values (concatenated in `values`) from column `start`."""
    out = np.full((len(lengths), width), pad_id, dtype=np.int64)
    columns = np.arange(width)
    # Boolean assignment fills True cells in row-major order: row 0's tokens first, and so on.
    out[(columns >= start) & (columns < start + lengths[:, None])] = values
    return out


def make_batch_from_flat(src_values: np.ndarray, src_lengths: np.ndarray, tgt_values: np.ndarray,
                         tgt_lengths: np.ndarray, pad_id: int, bos_id: int, eos_id: int,
                         pad_to_multiple: int = 1, max_length: int | None = None) -> Batch:
    """`make_batch` of sequences stored back to back: `*_values` (sum of lengths,), `*_lengths` (B,)."""
    src_lengths, tgt_lengths = np.asarray(src_lengths, dtype=np.int64), np.asarray(tgt_lengths, dtype=np.int64)
    rows = np.arange(len(src_lengths))
    S = int(padded_length(int(src_lengths.max()) + 1, pad_to_multiple, max_length))  # + EOS
    T = int(padded_length(int(tgt_lengths.max()) + 1, pad_to_multiple, max_length))  # + BOS (input) or EOS (output)
    src = _place_rows(src_values, src_lengths, S, pad_id, 0)  # (B, S)
    src[rows, src_lengths] = eos_id
    tgt_in = _place_rows(tgt_values, tgt_lengths, T, pad_id, 1)  # (B, T)
    tgt_in[:, 0] = bos_id
    tgt_out = _place_rows(tgt_values, tgt_lengths, T, pad_id, 0)  # (B, T)
    tgt_out[rows, tgt_lengths] = eos_id
    return Batch(src_ids=torch.from_numpy(src), tgt_in_ids=torch.from_numpy(tgt_in),
                 tgt_out_ids=torch.from_numpy(tgt_out), n_src_tokens=int(src_lengths.sum()) + len(rows),
                 n_tgt_tokens=int(tgt_lengths.sum()) + len(rows))


@dataclass(frozen=True)
class PackShape:
    """The fixed size of a pack: source and target tokens, the longest segment, and the most
    sentences a pack can hold (static bounds from the data, so that every pack has one shape)."""

    src_tokens: int
    tgt_tokens: int
    longest: int  # the longest pair's longer side (with EOS/BOS): filler pieces are no longer
    max_sentences: int | None = None  # None: one per target token

    @property
    def slots(self) -> int:
        """Segments a pack may hold at most, sentences and filler pieces: offsets (slots + 1,)."""
        sentences = min(self.src_tokens, self.tgt_tokens) if self.max_sentences is None else self.max_sentences
        return sentences + -(-max(self.src_tokens, self.tgt_tokens) // self.longest)


def pack_shape(src_lengths: np.ndarray, tgt_lengths: np.ndarray, tgt_tokens: int, multiple: int = 8) -> PackShape:
    """The pack of `tgt_tokens` target tokens for pairs of these source and target lengths (with
    EOS/BOS), its source side sized by their ratio (rounded up to `multiple`), so that both sides fill.
    A pair longer than the pack on either side is refused in one line naming `train.batch_tokens`."""
    src_lengths, tgt_lengths = np.asarray(src_lengths, dtype=np.int64), np.asarray(tgt_lengths, dtype=np.int64)
    ratio = float(src_lengths.sum()) / max(float(tgt_lengths.sum()), 1.0)
    src_tokens = round_up(max(int(np.ceil(tgt_tokens * ratio)), 1), multiple)
    for side, lengths, size in (("source", src_lengths, src_tokens), ("target", tgt_lengths, tgt_tokens)):
        i = int(np.argmax(lengths))
        if lengths[i] > size:
            raise DataError(f"train.batch_tokens: training pair {i + 1} has {int(lengths[i])} {side} tokens, more than "
                            f"a pack's {size} (train.batch_tokens {tgt_tokens} target tokens, the source side sized "
                            f"by the split's ratio {ratio:.2f}); raise train.batch_tokens to at least "
                            f"{int(np.ceil(lengths[i] / (ratio if side == 'source' else 1.0)))}")
    # No pack holds more sentences than the shortest ones that fill a side.
    fits = [int(np.searchsorted(np.cumsum(np.sort(lengths)), size, side="right"))
            for lengths, size in ((src_lengths, src_tokens), (tgt_lengths, tgt_tokens))]
    longest = int(max(src_lengths.max(initial=1), tgt_lengths.max(initial=1)))
    return PackShape(src_tokens, tgt_tokens, longest, max(min(fits), 1))


def _segment_offsets(lengths: np.ndarray, size: int, fillers: int, slots: int | None) -> np.ndarray:
    """(P+1,) int32: the sentences of `lengths`, the rest of `size` in `fillers` near-equal pieces,
    then empty segments up to `slots` (None: none)."""
    tail = size - int(lengths.sum())
    filler = np.full(fillers, tail // max(fillers, 1), dtype=np.int64)
    filler[:tail - int(filler.sum())] += 1
    pieces = np.concatenate([lengths, filler])
    if slots is not None:
        pieces = np.concatenate([pieces, np.zeros(slots - len(pieces), dtype=np.int64)])
    return np.concatenate([[0], np.cumsum(pieces)]).astype(np.int32)


def _laid(values: np.ndarray, lengths: np.ndarray, size: int, pad_id: int, first: int | None,
          last: int | None) -> np.ndarray:
    """(size,) int64: the sequences (back to back in `values`) end to end, each with `first` before
    or `last` after it, then pad."""
    out = np.full(size, pad_id, dtype=np.int64)
    starts = np.cumsum(lengths + 1) - lengths - 1  # (n,) each sentence's first slot
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[np.repeat(starts + (first is not None), lengths) + within] = values
    if first is not None:
        out[starts] = first
    if last is not None:
        out[starts + lengths] = last
    return out


def make_pack_from_flat(src_values: np.ndarray, src_lengths: np.ndarray, tgt_values: np.ndarray,
                        tgt_lengths: np.ndarray, shape: PackShape, pad_id: int, bos_id: int, eos_id: int,
                        static: bool = False) -> Batch:
    """A packed `Batch` of sequences stored back to back (as `make_batch_from_flat` takes them), laid end
    to end into `shape`'s tokens; the tail of each side is filler, in as many pieces on both sides
    (segment i is the same sentence or filler on both), none longer than the longest sentence.
    `static`: offsets of `shape.slots` + 1 entries and `longest` the shape's, so every pack has the
    same shapes."""
    src_lengths, tgt_lengths = np.asarray(src_lengths, dtype=np.int64), np.asarray(tgt_lengths, dtype=np.int64)
    n = len(src_lengths)
    src_used, tgt_used = int(src_lengths.sum()) + n, int(tgt_lengths.sum()) + n
    if src_used > shape.src_tokens or tgt_used > shape.tgt_tokens:
        raise ValueError(f"{n} sentences of {src_used} source and {tgt_used} target tokens overflow a pack of {shape}")
    # Attention's cost follows the longest segment: filler pieces no longer than the longest sentence
    # (static: than the shape's, which every pack shares).
    longest = shape.longest if static or not n else int(max(src_lengths.max(), tgt_lengths.max())) + 1
    fillers = -(-max(shape.src_tokens - src_used, shape.tgt_tokens - tgt_used) // longest)
    slots = shape.slots if static else None
    src_offsets = _segment_offsets(src_lengths + 1, shape.src_tokens, fillers, slots)
    tgt_offsets = _segment_offsets(tgt_lengths + 1, shape.tgt_tokens, fillers, slots)
    return Batch(torch.from_numpy(_laid(src_values, src_lengths, shape.src_tokens, pad_id, None, eos_id))[None],
                 torch.from_numpy(_laid(tgt_values, tgt_lengths, shape.tgt_tokens, pad_id, bos_id, None))[None],
                 torch.from_numpy(_laid(tgt_values, tgt_lengths, shape.tgt_tokens, pad_id, None, eos_id))[None],
                 src_used, tgt_used, torch.from_numpy(src_offsets), torch.from_numpy(tgt_offsets), longest)


def static_rows(batch: Batch, batch_tokens: int) -> int:
    """The rows of every batch of this one's padded lengths on a fixed-shape path: as many as the budget allows."""
    longest = max(batch.src_ids.shape[1], batch.tgt_in_ids.shape[1])
    return max(batch.src_ids.shape[0], batch_tokens // longest)


def pad_rows(batch: Batch, rows: int, pad_id: int, bos_id: int, eos_id: int) -> Batch:
    """`batch` with filler rows up to `rows`: source EOS, target BOS (finite attention), nothing to predict."""
    extra = rows - batch.src_ids.shape[0]
    if extra <= 0:
        return batch

    def grown(ids: torch.Tensor, first: int) -> torch.Tensor:
        filler = ids.new_full((extra, ids.shape[1]), pad_id)  # (extra, L)
        filler[:, 0] = first
        return torch.cat([ids, filler])  # (rows, L)

    return Batch(grown(batch.src_ids, eos_id), grown(batch.tgt_in_ids, bos_id), grown(batch.tgt_out_ids, pad_id),
                 batch.n_src_tokens, batch.n_tgt_tokens)


def token_budget_batches(order: np.ndarray, lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Cut `order` (N,), along which `lengths` never decrease, into batches (views) within the token budget."""
    order = np.asarray(order, dtype=np.int64)
    sorted_lengths = np.asarray(lengths)[order]  # (N,) non-decreasing
    batches: list[np.ndarray] = []
    start, n = 0, len(order)
    while start < n:
        # Every later example is at least as long, so at most batch_tokens // first fit.
        window = sorted_lengths[start:start + max(1, batch_tokens // max(int(sorted_lengths[start]), 1))]
        fits = np.arange(1, len(window) + 1) * window <= batch_tokens  # True..True False..False
        size = len(window) if fits.all() else max(int(np.argmin(fits)), 1)
        batches.append(order[start:start + size])
        start += size
    return batches


def greedy_packs(order: np.ndarray, src_lengths: np.ndarray, tgt_lengths: np.ndarray, src_tokens: int,
                 tgt_tokens: int) -> list[np.ndarray]:
    """Cut `order` (N,) into packs (views), in order: a pack takes examples while their source and
    target tokens (`*_lengths`, with EOS/BOS) fit in `src_tokens` and `tgt_tokens`."""
    order = np.asarray(order, dtype=np.int64)
    src, tgt = src_lengths[order].tolist(), tgt_lengths[order].tolist()
    packs, start, s, t = [], 0, 0, 0
    for i, (a, b) in enumerate(zip(src, tgt)):
        if s + a > src_tokens or t + b > tgt_tokens:
            packs.append(order[start:i])
            start, s, t = i, 0, 0
        s, t = s + a, t + b
    if start < len(order):
        packs.append(order[start:])
    return packs


class TokenBatchSampler:
    """Endless stream of training batches (arrays of example indices), resumable mid-epoch.

    Each epoch: a seeded shuffle, a stable sort by length (`lengths` (N,), padded as batches are; then
    `tie_break`), token-budget batches shuffled in groups of `world_size` (rank r takes the r-th of a
    group); a pure function of (seed, epoch, `cut`). With `pack` (and `pair_lengths`, each example's
    source and target tokens with EOS/BOS), packs instead of batches: the shuffled examples laid in
    that order into packs of `pack`'s tokens, a pack closed when the next example does not fit.
    `epoch_rows(e)`: the rows epoch e trains on. A resume with another cut (a switch between batches
    and packs included) cuts the rest of its epoch anew from the examples left (`earlier_parts`).
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_tokens: int, seed: int,
                 tie_break: Sequence[int] | np.ndarray | None = None, world_size: int = 1,
                 pad_to_multiple: int = 1, max_length: int | None = None,
                 epoch_rows: Callable[[int], np.ndarray] | None = None, pack: PackShape | None = None,
                 pair_lengths: tuple[np.ndarray, np.ndarray] | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int32)  # (N,) before padding
        self.pair_lengths = None if pair_lengths is None else tuple(np.asarray(x, dtype=np.int64) for x in pair_lengths)
        self.tie_break = None if tie_break is None else np.asarray(tie_break, dtype=np.int32)
        self.max_length = max_length
        # The rows of an epoch (None: every row once, and an example is its row); the last epoch's kept.
        self._epoch_rows = None if epoch_rows is None else functools.lru_cache(maxsize=1)(
            lambda epoch: np.asarray(epoch_rows(epoch), dtype=np.int64))
        self.cut = {"batch_tokens": batch_tokens, "world_size": world_size, "pad_to_multiple": pad_to_multiple}
        if pack is not None:
            self.cut = {"pack_tokens": [pack.src_tokens, pack.tgt_tokens], "world_size": world_size}
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches of the current epoch (of its last part) already handed out
        self.earlier_parts: list[tuple[dict, int]] = []  # (cut, batches handed out) of this epoch's earlier parts

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches in training order (after a changed cut in the current epoch, its last part's)."""
        rows = None if self._epoch_rows is None else self._epoch_rows(epoch)
        n_examples = len(self.lengths) if rows is None else len(rows)
        parts = self.earlier_parts if epoch == self.epoch else []
        left = None  # (n_examples,) bool: examples that no earlier part handed out; None: all
        for part, (cut, handed_out) in enumerate(parts):
            used = self._cut_epoch(epoch, part, cut, left, rows)[:handed_out]
            left = np.ones(n_examples, dtype=bool) if left is None else left
            left[np.concatenate(used) if used else []] = False
        batches = self._cut_epoch(epoch, len(parts), self.cut, left, rows)
        return batches if rows is None else [rows[batch] for batch in batches]

    def _cut_epoch(self, epoch: int, part: int, cut: dict, left: np.ndarray | None,
                   rows: np.ndarray | None) -> list[np.ndarray]:
        """Part `part` of epoch `epoch`: batches of the examples in `left` (None: all; indices into `rows`)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        shuffled = torch.randperm(len(self.lengths) if rows is None else len(rows), generator=gen).numpy()
        if part:  # the same shuffle of the examples, another shuffle of the batch groups
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_009 + part)
        if "pack_tokens" in cut:
            src, tgt = self.pair_lengths
            if rows is not None:
                src, tgt = src[rows], tgt[rows]
            batches = greedy_packs(shuffled if left is None else shuffled[left[shuffled]], src, tgt, *cut["pack_tokens"])
        else:
            lengths = padded_length(self.lengths, cut["pad_to_multiple"], self.max_length)
            tie_break = self.tie_break
            if rows is not None:  # each example's length is its row's (this epoch's segmentation)
                lengths, tie_break = lengths[rows], None if tie_break is None else tie_break[rows]
            keys = (lengths[shuffled],) if tie_break is None else (tie_break[shuffled], lengths[shuffled])
            by_length = shuffled[np.lexsort(keys)]  # the last key sorts first; stable: remaining ties stay shuffled
            if left is not None:
                by_length = by_length[left[by_length]]
            batches = token_budget_batches(by_length, lengths, cut["batch_tokens"])
        W = cut["world_size"]
        # An incomplete last group (the longest batches) is filled with the shortest batches,
        # which then come twice this epoch; dropping it would never train on the longest pairs.
        n = len(batches)
        batches += [batches[i % n] for i in range(-n % W)]
        groups = [batches[i:i + W] for i in range(0, len(batches), W)]
        return [batch for i in torch.randperm(len(groups), generator=gen).tolist() for batch in groups[i]]

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1
                yield batches[self.position - 1]
            self.epoch += 1
            self.position = 0
            self.earlier_parts = []

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "cut": dict(self.cut),
                "earlier_parts": [[dict(cut), handed_out] for cut, handed_out in self.earlier_parts]}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; with a changed cut, the rest of its epoch is cut anew."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.earlier_parts = [(dict(cut), int(handed_out)) for cut, handed_out in state["earlier_parts"]]
        saved_cut = state["cut"]
        if saved_cut != self.cut and self.position:
            self.earlier_parts.append((dict(saved_cut), self.position))
            self.position = 0
            logger.info("batches are cut differently now (%s, was %s): the rest of epoch %d is cut anew "
                        "from the examples it has not trained on", self.cut, saved_cut, self.epoch + 1)


def sorted_batches(lengths: Sequence[int] | np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Deterministic batches for evaluation: examples sorted by length (stable), cut by token budget."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return token_budget_batches(np.argsort(lengths, kind="stable"), lengths, batch_tokens)
