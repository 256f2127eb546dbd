"""An update's batches: the seeded token-budget sampler over the training split, and each drawn
micro-batch padded (to fixed row counts for the GPU engine) and put on the device."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from transformer_mt.config.schema import Config
from transformer_mt.core.distributed import Distributed
from transformer_mt.data.batching import Batch, TokenBatchSampler, pad_rows, static_rows
from transformer_mt.data.token_cache import TokenizedSplit
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID


@dataclass
class StepBatches:
    """One update's micro-batches, drawn from the sampler and already on the device."""

    micro_batches: list[Batch]  # this rank's
    indices: list[np.ndarray]  # their example indices
    tgt_tokens: int  # target tokens of every rank's micro-batches: the loss's denominator
    sampler_state: dict  # the sampler's position once these batches are drawn


class BatchSource:
    """The training split's batches for `TrainStep`: `sampler` cuts them (resumable, its state in
    every checkpoint), `draw` takes one update's worth, `load` puts one on the device."""

    def __init__(self, cfg: Config, train_data: TokenizedSplit, *, device: torch.device, dist: Distributed,
                 pad_to_multiple: int, fixed_rows: bool):
        self.cfg = cfg
        self.train_data = train_data
        self.device = device
        self.dist = dist
        self.pad_to_multiple = pad_to_multiple
        self.fixed_rows = fixed_rows  # the GPU engine: a fixed row count per padded length
        self.sampler = TokenBatchSampler(train_data.lengths(), cfg.train.batch_tokens, cfg.seed,
                                         tie_break=train_data.tgt_len, world_size=dist.world_size,
                                         pad_to_multiple=pad_to_multiple, max_length=cfg.model.max_len,
                                         epoch_rows=train_data.epoch_rows)

    def load(self, indices: list[int] | np.ndarray) -> Batch:
        """Training examples -> a padded batch on the device; on CUDA through pinned memory, so the
        copy is asynchronous (`non_blocking`) and overlaps with queued GPU work."""
        batch = self.train_data.batch(indices, self.pad_to_multiple)
        if self.fixed_rows:  # shapes repeat, so captured graphs replay
            batch = pad_rows(batch, static_rows(batch, self.cfg.train.batch_tokens), PAD_ID, BOS_ID, EOS_ID)
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device)

    def draw(self, batches: Iterator[np.ndarray]) -> StepBatches:
        """The next update's batches from `iter(self.sampler)`: every rank's, in groups of W; this
        rank's on the device."""
        W = self.dist.world_size
        step_batches = [next(batches) for _ in range(self.cfg.train.accum_steps * W)]
        indices = step_batches[self.dist.rank::W]  # this rank's micro-batches
        tgt_tokens = int(self.train_data.lengths_of(np.concatenate(step_batches))[1].sum())
        return StepBatches([self.load(i) for i in indices], indices, tgt_tokens, self.sampler.state_dict())
