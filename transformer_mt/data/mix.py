"""Several corpora trained on together (`data.corpora`): each entry opened as a corpus of its own,
their training splits read one after another, and the pairs each epoch draws from each by weight.

Corpus c of n_c training pairs and weight w_c gives every epoch m_c = round(w_c × n_c) pairs
(halves rounded up): each of its pairs m_c // n_c times, and m_c mod n_c distinct pairs more,
drawn afresh each epoch by a generator seeded by (seed, epoch, c). Weight 2 shows each pair
twice an epoch, 0.5 a random half of them, drawn anew each epoch (independently: two epochs
need not cover the corpus), 1.5 each pair once and a random half of them again. An epoch's
pairs are thus a pure function of the seed and the epoch number, which is what makes a resume
exact. Validation and test come from the first corpus.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from transformer_mt.config.schema import CorpusEntry, DataConfig
from transformer_mt.core.errors import DataError
from transformer_mt.data.hub import hub_sources
from transformer_mt.data.sources import PairChunk, SplitSource, local_sources

logger = logging.getLogger(__name__)

# `data.path`, `data.format`, ... in a message about one corpus: the keys its entry sets for itself.
_SOURCE_KEYS = re.compile(r"\bdata\.(%s)\b" % "|".join(
    field.name for field in dataclasses.fields(CorpusEntry) if field.name != "weight"))


@dataclass(frozen=True)
class OpenedCorpora:
    """The sources a run reads: train from every corpus in turn, valid and test from the first."""

    sources: dict[str, SplitSource | None]
    """train (every corpus's, one after another), valid and test (the first corpus's; None: carved)."""
    train_parts: tuple[SplitSource, ...]
    """Each corpus's own training source, in `data.corpora` order (one for `data.path`)."""
    labels: tuple[str, ...]
    """Each corpus's path, for the report and messages."""


def corpus_configs(cfg: DataConfig) -> list[DataConfig]:
    """One `DataConfig` per corpus: `cfg` itself for `data.path`, else each `data.corpora` entry's
    source keys over `cfg`'s (languages, filters and unset keys stay `cfg`'s)."""
    if not cfg.corpora:
        return [cfg]
    return [dataclasses.replace(cfg, path=entry.path, corpora=(), format=entry.format or cfg.format,
                                hub_config=entry.hub_config if entry.hub_config is not None else cfg.hub_config,
                                revision=entry.revision if entry.revision is not None else cfg.revision)
            for entry in cfg.corpora]


def corpus_weights(cfg: DataConfig) -> tuple[float, ...]:
    """Each corpus's weight; `data.path` is one corpus of weight 1."""
    return tuple(entry.weight for entry in cfg.corpora) or (1.0,)


def open_corpora(cfg: DataConfig) -> OpenedCorpora:
    """Open every corpus's sources (local files or a hub dataset); with one corpus, its own sources."""
    configs = corpus_configs(cfg)
    opened = [_opened(one, f"data.corpora[{i}]" if cfg.corpora else "") for i, one in enumerate(configs)]
    labels = tuple(one.path for one in configs)
    if len(opened) == 1:
        return OpenedCorpora(opened[0], (opened[0]["train"],), labels)
    ignored = [f"{label} ({split})" for label, sources in zip(labels[1:], opened[1:])
               for split in ("valid", "test") if sources[split] is not None]
    if ignored:
        logger.info("validation and test come from the first corpus, %s; not read: %s", labels[0], ", ".join(ignored))
    parts = tuple(sources["train"] for sources in opened)
    train = SplitSource(description=" + ".join(part.description for part in parts),
                        key="corpora:" + json.dumps([[one.format, part.key] for one, part in zip(configs, parts)]),
                        chunks=lambda: _chained(parts))
    return OpenedCorpora({"train": train, "valid": opened[0]["valid"], "test": opened[0]["test"]}, parts, labels)


def _opened(cfg: DataConfig, entry: str) -> dict[str, SplitSource | None]:
    """The sources of one corpus; an error names the `data.corpora` entry at fault, when there is one:
    its own keys where the message names `data.path`, `data.format`, `data.hub_config` or
    `data.revision` (the entry's stand for them), else the entry and its path before the message."""
    try:
        return hub_sources(cfg) if cfg.format == "hub" else local_sources(cfg)
    except DataError as err:
        if not entry:
            raise
        message = _SOURCE_KEYS.sub(lambda key: f"{entry}.{key[1]}", str(err))
        raise DataError(message if f"{entry}." in message else f"{entry} ({cfg.path}): {message}") from None


def _chained(parts: tuple[SplitSource, ...]) -> Iterator[PairChunk]:
    for part in parts:
        yield from part.chunks()


def pairs_per_epoch(counts: tuple[int, ...], weights: tuple[float, ...]) -> list[int]:
    """Pairs each corpus gives every epoch: its count times its weight, rounded (halves up)."""
    return [math.floor(n * w + 0.5) for n, w in zip(counts, weights)]


def mixture(counts: tuple[int, ...], weights: tuple[float, ...], seed: int, epoch: int) -> np.ndarray:
    """(sum of `pairs_per_epoch`,) int64: the pair numbers epoch `epoch` trains on, corpus by corpus,
    where corpus c's pairs are numbers sum(counts[:c]) .. sum(counts[:c + 1]) - 1 (see the module
    docstring). The order does not matter: the sampler shuffles each epoch."""
    chosen, start = [], 0
    for c, (n, wanted) in enumerate(zip(counts, pairs_per_epoch(counts, weights))):
        pairs = np.arange(start, start + n, dtype=np.int64)
        whole, extra = divmod(wanted, n) if n else (0, 0)
        chosen.extend([pairs] * whole)
        if extra:
            drawn = np.random.default_rng([seed, epoch, c]).choice(n, size=extra, replace=False)
            chosen.append(start + np.sort(drawn))
        start += n
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
