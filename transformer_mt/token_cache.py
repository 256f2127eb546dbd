"""Tokenize each split once: token ids cached on disk as Arrow (memory-mapped, via `datasets`).

The cache of a run lives in `<run_dir>/token_cache/<split>-<fingerprint>/` (a `datasets`
`save_to_disk` folder). The fingerprint covers the split's text (so the data files and the
data.* filters), the tokenizer(s), `model.max_len` and whether over-long pairs are dropped;
any change makes a new entry and removes the split's old one. Restarts and resumes reuse it,
so training never tokenizes per step.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer_mt.batching import Batch, make_batch_from_flat
from transformer_mt.errors import DataError
from transformer_mt.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

CACHE_DIR = "token_cache"
CACHE_FORMAT = 1  # bump when the stored columns change
ENCODE_BATCH_ROWS = 10_000


class TokenizedSplit:
    """One split as token ids (no special tokens; at most `max_len - 1` per side), Arrow-backed.

    Columns `src_ids`, `tgt_ids` (list<int32>); `src_len`, `tgt_len` (int32) are also held as
    numpy arrays, so batching touches only index and length arrays until a batch is built.
    `src_text` / `tgt_text` are kept for evaluation splits (references, examples), else None.
    """

    def __init__(self, dataset: datasets.Dataset, src_text: Sequence[str] | None = None,
                 tgt_text: Sequence[str] | None = None):
        self.dataset = dataset
        self._arrow = dataset.with_format("arrow")
        table = self._arrow[:]  # a zero-copy pyarrow view (a numpy-formatted column would convert row by row)
        self.src_len = table.column("src_len").to_numpy().astype(np.int64)
        self.tgt_len = table.column("tgt_len").to_numpy().astype(np.int64)
        self.src_text, self.tgt_text = src_text, tgt_text
        self._src_ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.src_len)

    @property
    def src_ids(self) -> list[list[int]]:
        """Every source sequence as a list (for decoding); built on first use."""
        if self._src_ids is None:
            self._src_ids = self._arrow[:].column("src_ids").to_pylist()
        return self._src_ids

    def lengths(self) -> np.ndarray:
        """(N,) padded length of each example in a batch: the longer side plus its EOS/BOS."""
        return np.maximum(self.src_len, self.tgt_len) + 1

    def lengths_of(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Real source (+EOS) and target (+EOS) lengths of the given examples."""
        idx = np.asarray(indices, dtype=np.int64)
        return self.src_len[idx] + 1, self.tgt_len[idx] + 1

    def ids(self, indices: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Source and target token ids of the given examples, as lists."""
        rows = self._arrow[list(indices)]
        return rows.column("src_ids").to_pylist(), rows.column("tgt_ids").to_pylist()

    def batch(self, indices: Sequence[int], pad_to_multiple: int = 1) -> Batch:
        """The padded `Batch` of the given examples, straight from the Arrow buffers."""
        idx = list(indices)
        rows = self._arrow[idx]  # a pyarrow Table of these rows, in this order
        src = rows.column("src_ids").combine_chunks().flatten().to_numpy()
        tgt = rows.column("tgt_ids").combine_chunks().flatten().to_numpy()
        return make_batch_from_flat(src, self.src_len[idx], tgt, self.tgt_len[idx], PAD_ID, BOS_ID, EOS_ID,
                                    pad_to_multiple)


def fingerprint(src_lines: Sequence[str], tgt_lines: Sequence[str], tokenizers: TokenizerPair, max_len: int,
                drop_long: bool) -> str:
    """Hex digest of everything the cached ids depend on."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (f"tmt-token-cache-{CACHE_FORMAT}", f"max_len={max_len}", f"drop_long={drop_long}",
                 tokenizers.src.to_str(), "" if tokenizers.joint else tokenizers.tgt.to_str(),
                 f"rows={len(src_lines)}", "\n".join(src_lines), "\n".join(tgt_lines)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")  # so that moving text between parts changes the digest
    return digest.hexdigest()


def tokenize_split(split: datasets.Dataset, tokenizers: TokenizerPair, max_len: int, cache_root: Path, name: str,
                   *, drop_long: bool, keep_text: bool = False, progress: bool = False) -> TokenizedSplit:
    """Token ids of `split` (columns `src`, `tgt`), from `cache_root` when cached, else encoded and cached.

    drop_long: remove pairs with a side longer than `max_len - 1` tokens (training: a truncated
    pair would teach the model to stop mid-sentence); otherwise truncate them (evaluation sets
    are never filtered). Raises `DataError` when dropping leaves nothing. `progress` shows the
    encoding's progress bar on stderr when it is a terminal.
    """
    import datasets

    src_lines, tgt_lines = split["src"][:], split["tgt"][:]  # lists: a datasets Column reads ~40 µs a row
    key = fingerprint(src_lines, tgt_lines, tokenizers, max_len, drop_long)
    path = Path(cache_root) / f"{name}-{key}"
    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))  # memory-mapped Arrow files
        logger.info("%s split: token ids from the cache %s", name, path)
    else:
        was_enabled = datasets.is_progress_bar_enabled()
        if not (progress and sys.stderr.isatty()):
            datasets.disable_progress_bars()  # not a terminal: the log line below says what happened
        try:
            dataset = _encode(split, tokenizers, max_len, drop_long, key, name)
            if len(dataset):  # (an empty one is refused below, and `datasets` cannot reload it)
                _store(dataset, path, name)
                dataset = datasets.load_from_disk(str(path))
        finally:
            if was_enabled:
                datasets.enable_progress_bars()
    if len(dataset) == 0:
        raise DataError(f"no {'training' if name == 'train' else name} pair fits in model.max_len={max_len} tokens")
    removed = len(src_lines) - len(dataset)
    if removed:
        logger.info("filter too_many_tokens: removed %d %s pairs longer than model.max_len=%d tokens",
                    removed, name, max_len)
    return TokenizedSplit(dataset, src_lines if keep_text else None, tgt_lines if keep_text else None)


def _encode(split: datasets.Dataset, tokenizers: TokenizerPair, max_len: int, drop_long: bool,
            key: str, name: str) -> datasets.Dataset:
    """Batched fast-tokenizer pass over the split (`encode_batch` runs in Rust, over all cores)."""
    import datasets

    keep = max_len - 1  # room for EOS (source, target output) or BOS (target input)

    def encode(rows: dict) -> dict:
        src_ids, tgt_ids = tokenizers.encode_src(rows["src"]), tokenizers.encode_tgt(rows["tgt"])
        if drop_long:
            fits = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids)) if len(s) <= keep and len(t) <= keep]
            src_ids, tgt_ids = [src_ids[i] for i in fits], [tgt_ids[i] for i in fits]
        src_ids, tgt_ids = [ids[:keep] for ids in src_ids], [ids[:keep] for ids in tgt_ids]
        return {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_len": [len(s) for s in src_ids],
                "tgt_len": [len(t) for t in tgt_ids]}

    features = datasets.Features({"src_ids": datasets.Sequence(datasets.Value("int32")),
                                  "tgt_ids": datasets.Sequence(datasets.Value("int32")),
                                  "src_len": datasets.Value("int32"), "tgt_len": datasets.Value("int32")})
    # A batched map may return fewer rows than it gets, because it replaces every input column.
    return split.map(encode, batched=True, batch_size=ENCODE_BATCH_ROWS, remove_columns=split.column_names,
                     features=features, keep_in_memory=True, load_from_cache_file=False, new_fingerprint=key,
                     desc=f"tokenize {name}")


def _store(dataset: datasets.Dataset, path: Path, name: str) -> None:
    """Write the entry atomically (a temporary folder renamed into place); drop the split's old entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    dataset.save_to_disk(str(temp))
    temp.rename(path)
    for old in path.parent.glob(f"{name}-*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("%s split: tokenized %d pairs once; token ids cached in %s", name, len(dataset), path)
