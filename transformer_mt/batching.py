"""Token ids -> padded `Batch`es; a seeded, length-bucketed, token-budget, resumable sampler."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """One padded batch. Source ends with EOS; the target is shifted for teacher forcing."""

    src_ids: torch.Tensor  # (B, S) long: tokens + EOS, then pad
    tgt_in_ids: torch.Tensor  # (B, T) long: BOS + tokens, then pad
    tgt_out_ids: torch.Tensor  # (B, T) long: tokens + EOS, then pad
    n_src_tokens: int  # real (non-pad) source tokens
    n_tgt_tokens: int  # real target tokens predicted: the loss normaliser

    def to(self, device: torch.device) -> Batch:
        return Batch(self.src_ids.to(device, non_blocking=True), self.tgt_in_ids.to(device, non_blocking=True),
                     self.tgt_out_ids.to(device, non_blocking=True), self.n_src_tokens, self.n_tgt_tokens)


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Right-pad id lists to one (N, max_len) long tensor."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def make_batch(src_seqs: Sequence[Sequence[int]], tgt_seqs: Sequence[Sequence[int]],
               pad_id: int, bos_id: int, eos_id: int) -> Batch:
    """Build a `Batch` from token-id lists that carry no special tokens."""
    src = [list(s) + [eos_id] for s in src_seqs]
    tgt_in = [[bos_id] + list(t) for t in tgt_seqs]
    tgt_out = [list(t) + [eos_id] for t in tgt_seqs]
    return Batch(
        src_ids=pad_sequences(src, pad_id),
        tgt_in_ids=pad_sequences(tgt_in, pad_id),
        tgt_out_ids=pad_sequences(tgt_out, pad_id),
        n_src_tokens=sum(map(len, src)),
        n_tgt_tokens=sum(map(len, tgt_out)),
    )


def token_budget_batches(order: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Cut `order` into consecutive batches whose size × longest length stays within the budget.

    A single example longer than the budget still gets a batch of its own.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for idx in order:
        new_longest = max(longest, lengths[idx])
        if current and (len(current) + 1) * new_longest > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[idx]
        current.append(idx)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


class TokenBatchSampler:
    """Endless stream of training batches (lists of example indices), resumable mid-epoch.

    Each epoch: a seeded shuffle, a stable sort by length (so similar lengths share a batch
    and little is padding), cut into token-budget batches, then the batch order is shuffled
    in groups of `world_size` neighbours: a DDP step takes one group, rank r its r-th batch,
    so every rank gets a batch of similar length. With `world_size` 1 every batch is its own
    group. The batches of epoch e depend only on (seed, e, world_size), so the state is just
    (epoch, position).
    """

    def __init__(self, lengths: Sequence[int], batch_tokens: int, seed: int, world_size: int = 1):
        self.lengths = list(lengths)  # padded length of each example: max(source, target) + 1
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches in training order; their count is a multiple of `world_size`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        shuffled = torch.randperm(len(self.lengths), generator=gen).tolist()
        by_length = sorted(shuffled, key=self.lengths.__getitem__)  # stable: ties stay shuffled
        batches = token_budget_batches(by_length, self.lengths, self.batch_tokens)
        W = self.world_size
        # An incomplete last group (the longest batches) is filled with the shortest batches,
        # which then come twice this epoch; dropping it would never train on the longest pairs.
        n = len(batches)
        batches += [batches[i % n] for i in range(-n % W)]
        groups = [batches[i:i + W] for i in range(0, len(batches), W)]
        return [batch for i in torch.randperm(len(groups), generator=gen).tolist() for batch in groups[i]]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1
                yield batches[self.position - 1]
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def sorted_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Deterministic batches for evaluation: examples sorted by length, cut by token budget."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return token_budget_batches(order, lengths, batch_tokens)
