"""The training split as the sampler draws it: one table of token ids of every corpus's pairs in plain BPE
and K cached BPE-dropout segmentations, and `EpochRows`, the rows of each epoch (a pure function of the seed
and the epoch, so a resume is exact)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformer_mt.config.schema import Config
from transformer_mt.core.errors import ConfigError, DataError
from transformer_mt.data.corpus import Corpus
from transformer_mt.data.token_cache import TokenizedSplit, processes_for, tokenize_split
from transformer_mt.data.tokenization import TokenizerPair

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochRows:
    """The rows epoch e trains on: pairs `pairs(e)` of block `variant(e)` (plain BPE, then each segmentation)."""

    counts: tuple[int, ...]  # training pairs of each corpus
    weights: tuple[float, ...]
    seed: int
    variants: int = 0  # K: BPE-dropout segmentations cycled by epoch; 0: plain BPE only
    start_epoch: int = 0  # the first epoch on a dropout segmentation; earlier ones on plain BPE

    @property
    def n_pairs(self) -> int:
        return sum(self.counts)

    def variant(self, epoch: int) -> int:
        """The block epoch `epoch` trains on: 0 (plain BPE), or a BPE-dropout variant 1..K."""
        return 1 + epoch % self.variants if self.variants and epoch >= self.start_epoch else 0

    def pairs(self, epoch: int) -> np.ndarray:
        """(sum of `pairs_per_epoch`,) int64: the pair numbers (rows of block 0, corpus c's from sum(counts[:c]))
        of epoch `epoch`: each m_c // n_c times, and m_c mod n_c more drawn seeded by (seed, epoch, c)."""
        chosen, start = [], 0
        for c, (n, wanted) in enumerate(zip(self.counts, self.pairs_per_epoch())):
            whole, extra = divmod(wanted, n) if n else (0, 0)
            chosen.extend([np.arange(start, start + n, dtype=np.int64)] * whole)
            if extra:
                drawn = np.random.default_rng([self.seed, epoch, c]).choice(n, size=extra, replace=False)
                chosen.append(start + np.sort(drawn))
            start += n
        return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)

    def __call__(self, epoch: int) -> np.ndarray:
        return self.pairs(epoch) + self.variant(epoch) * self.n_pairs

    def pairs_per_epoch(self) -> list[int]:
        """m_c: the pairs corpus c gives every epoch, its count times its weight rounded (halves up)."""
        return [math.floor(n * w + 0.5) for n, w in zip(self.counts, self.weights)]


def tokenize_training_split(cfg: Config, corpus: Corpus, tokenizers: TokenizerPair, cache: Path, *,
                            progress: bool = False, prepared: bool = False) -> TokenizedSplit:
    """The training pairs as token ids (a cache entry per corpus and BPE-dropout variant) with their `EpochRows`."""
    import datasets

    parts = corpus.train_parts
    variants = cfg.tokenizer.bpe_dropout_variants if cfg.tokenizer.bpe_dropout else 0
    blocks: list[list[TokenizedSplit]] = [[] for _ in range(variants + 1)]  # [variant][corpus]
    start = 0
    started = time.perf_counter()
    for c, (label, n_rows) in enumerate(parts):
        split, digest, name = corpus.train, corpus.digests["train"], "train"
        if len(parts) > 1:  # each corpus's rows of train: their own entries, so each keeps its pair count
            if not n_rows:
                raise DataError(f"data.corpora[{c}] ({label}): no training pair is left after the filters "
                                "(data.max_words, data.max_length_ratio)")
            split, digest, name = (corpus.train.select(range(start, start + n_rows)),
                                   f"{digest}:{start}:{start + n_rows}", f"train.c{c}")
        for v in range(variants + 1):
            try:
                blocks[v].append(tokenize_split(
                    split, digest, tokenizers, cfg.model.max_len, cache, name if v == 0 else f"{name}.v{v}",
                    drop_long=True, num_proc=processes_for(len(split), cfg.data.num_proc), progress=progress,
                    prepared=prepared, bpe_dropout=cfg.tokenizer.bpe_dropout if v else 0.0, variant=v))
            except DataError as err:  # e.g. none of this corpus's pairs fits in model.max_len: say which corpus
                if len(parts) == 1:
                    raise
                raise DataError(f"data.corpora[{c}] ({label}): {err}") from None
        start += n_rows
    weights = tuple(entry.weight for entry in cfg.data.corpora) or (1.0,)  # `data.path`: one corpus of weight 1
    if variants == 0 and weights == (1.0,):
        return blocks[0][0]
    if variants:
        start_epoch = cfg.tokenizer.bpe_dropout_start_epoch
        logger.info("BPE-dropout %.2f: %d segmentations of the training split in the token cache, epoch e%s trains on "
                    "number 1 + e mod %d (%.1fs to read or encode them all)", cfg.tokenizer.bpe_dropout, variants,
                    f" >= {start_epoch}" if start_epoch else "", variants, time.perf_counter() - started)
    plan = EpochRows(tuple(len(piece) for piece in blocks[0]), weights, cfg.seed, variants,
                     cfg.tokenizer.bpe_dropout_start_epoch)
    for c, ((label, _), n, weight, wanted) in enumerate(zip(parts, plan.counts, weights, plan.pairs_per_epoch())):
        if cfg.data.corpora and not wanted:  # a corpus left unused by its weight: name the least that uses it
            digits = 2 - math.floor(math.log10(0.5 / n))  # three significant ones, rounded up: enough for one pair
            raise ConfigError([f"data.corpora[{c}].weight: {weight:g} gives the {n:,} training pairs of {label} none "
                               f"per epoch (round({weight:g} x {n:,}) = 0); raise it to at least "
                               f"{math.ceil(0.5 / n * 10 ** digits) / 10 ** digits:g}"])
    if not sum(plan.pairs_per_epoch()):
        raise ConfigError(["data.corpora: the weights give an epoch no training pairs; raise them"])
    pieces = [piece.dataset for block in blocks for piece in block]
    table = pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)
    return TokenizedSplit(table, cfg.model.max_len, epoch_rows=plan, n_pairs=plan.n_pairs)
