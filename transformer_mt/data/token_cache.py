"""Each split tokenized once: token ids cached as memory-mapped Arrow in `<run_dir>/token_cache/<split>-<key>/`."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import numpy as np

from transformer_mt.core.errors import DataError, missing_from_rank0
from transformer_mt.core.files import naming, removed_on_failure
from transformer_mt.core.signals import signals_deferred
from transformer_mt.data.batching import Batch, PackShape, make_batch_from_flat, make_pack_from_flat, padded_length
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair, WordIds, token_room

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the stored columns or the entry layout change
ENCODE_BATCH_ROWS = 10_000
ENTRY_FILE = "entry.json"  # the entry's Arrow files, in row order; written last
MIN_ROWS_PER_PROCESS = 50_000
MAX_AUTO_PROCESSES = 8
# A split of at most this many ids a side is also held in memory (256 MB), so a batch is a fast numpy gather.
IN_MEMORY_MAX_IDS = 2 ** 26
STOP_WAIT_S = 1.0  # the most a killed tokenizing process is waited for


class TokenizedSplit:
    """One split as token ids (no special tokens, at most `max_len - 1` a side): Arrow columns `src_ids`, `tgt_ids`
    and numpy `src_len`, `tgt_len` (N,); a training table's `epoch_rows(epoch)` names the rows of an epoch."""

    def __init__(self, dataset: datasets.Dataset, max_len: int, src_text: Sequence[str] | None = None,
                 tgt_text: Sequence[str] | None = None, *, epoch_rows: Callable[[int], np.ndarray] | None = None,
                 n_pairs: int | None = None):
        self.dataset = dataset
        self.epoch_rows = epoch_rows
        self.n_pairs = len(dataset) if n_pairs is None else n_pairs
        self.max_len = max_len
        self._arrow = dataset.with_format("arrow")
        self._table = self._arrow[:]  # a zero-copy pyarrow view of the (memory-mapped) rows
        self.src_len = self._table.column("src_len").to_numpy()
        self.tgt_len = self._table.column("tgt_len").to_numpy()
        self.src_text, self.tgt_text = src_text, tgt_text
        self._flat = None  # (src ids, src offsets, tgt ids, tgt offsets) in memory, for a small enough split
        if max(int(self.src_len.sum()), int(self.tgt_len.sum())) <= IN_MEMORY_MAX_IDS:
            self._flat = (*_flat_column(self._table, "src_ids"), *_flat_column(self._table, "tgt_ids"))

    def __len__(self) -> int:
        return self.n_pairs

    @functools.cached_property
    def src_ids(self) -> list[list[int]]:
        """Every source sequence as a list (for decoding an evaluation split)."""
        return self._table.column("src_ids").to_pylist()

    def lengths(self, pad_to_multiple: int = 1) -> np.ndarray:
        """(N,) padded length of each example in a batch: the longer side plus its EOS/BOS, padded as `batch` pads."""
        return padded_length(np.maximum(self.src_len, self.tgt_len) + 1, pad_to_multiple, self.max_len)

    def lengths_of(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Real source (+EOS) and target (+EOS) lengths of the given examples."""
        idx = np.asarray(indices, dtype=np.int64)
        return self.src_len[idx] + 1, self.tgt_len[idx] + 1

    def ids(self, indices: Sequence[int] | np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """Source and target token ids of the given examples, as lists."""
        rows = self._rows(indices)
        return rows.column("src_ids").to_pylist(), rows.column("tgt_ids").to_pylist()

    def _rows(self, indices: Sequence[int] | np.ndarray) -> pa.Table:
        """A pyarrow Table of the given rows, in order (gathered by `datasets`, unlike `Table.take`, cheaply)."""
        return self._arrow[np.asarray(indices, dtype=np.int64).tolist()]

    def batch(self, indices: Sequence[int] | np.ndarray, pad_to_multiple: int = 1) -> Batch:
        """The padded `Batch` of the given examples, from the in-memory ids or the Arrow buffers."""
        idx = np.asarray(indices, dtype=np.int64)
        src, tgt = self._flat_ids(idx)
        return make_batch_from_flat(src, self.src_len[idx], tgt, self.tgt_len[idx], PAD_ID, BOS_ID, EOS_ID,
                                    pad_to_multiple, self.max_len)

    def pack(self, indices: Sequence[int] | np.ndarray, shape: PackShape, static: bool = False) -> Batch:
        """The given examples laid end to end in one packed `Batch` of `shape` (`make_pack_from_flat`)."""
        idx = np.asarray(indices, dtype=np.int64)
        src, tgt = self._flat_ids(idx)
        return make_pack_from_flat(src, self.src_len[idx], tgt, self.tgt_len[idx], shape, PAD_ID, BOS_ID, EOS_ID,
                                   static)

    def _flat_ids(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source and the target ids of examples `idx`, each side back to back."""
        if self._flat is not None:
            src_ids, src_offsets, tgt_ids, tgt_offsets = self._flat
            return _gather(src_ids, src_offsets, self.src_len, idx), _gather(tgt_ids, tgt_offsets, self.tgt_len, idx)
        rows = self._rows(idx)
        return (rows.column("src_ids").combine_chunks().flatten().to_numpy(),
                rows.column("tgt_ids").combine_chunks().flatten().to_numpy())


def _flat_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list<int32> column as (every row's ids back to back, (N,) int64 start of each row)."""
    import pyarrow as pa

    column = table.column(name).combine_chunks()  # one ListArray
    if isinstance(column, pa.ChunkedArray):  # older pyarrow returns a ChunkedArray of one chunk
        column = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], type=column.type)
    offsets = column.offsets.to_numpy().astype(np.int64)  # (N + 1,); `flatten` starts at offsets[0]
    return column.flatten().to_numpy(), offsets[:-1] - offsets[0]


def _gather(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The ids of rows `idx`, back to back, as `make_batch_from_flat` takes them; one numpy gather."""
    n = lengths[idx].astype(np.int64)  # (B,)
    first = np.repeat(starts[idx] - np.cumsum(n) + n, n)  # each output position's row start, shifted
    return values[first + np.arange(int(n.sum()))]


def processes_for(n_rows: int, num_proc: int | None) -> int:
    """Tokenizing processes for `n_rows`: `num_proc` (None: cores, at most 8), each of `MIN_ROWS_PER_PROCESS`."""
    wanted = num_proc if num_proc is not None else min(os.cpu_count() or 1, MAX_AUTO_PROCESSES)
    return max(1, min(wanted, n_rows // MIN_ROWS_PER_PROCESS))


def tokenize_split(split: datasets.Dataset, text_digest: str, tokenizers: TokenizerPair, max_len: int,
                   cache_root: Path, name: str, *, drop_long: bool, keep_text: bool = False,
                   num_proc: int = 1, progress: bool = False, prepared: bool = False, bpe_dropout: float = 0.0,
                   variant: int = 0) -> TokenizedSplit:
    """Token ids of `split` (columns `src`, `tgt`), from `cache_root` when cached, else encoded and cached.

    `drop_long`: drop pairs with a side over `max_len - 1` tokens (training), else cut them. `prepared`: only
    read what rank 0 cached. `bpe_dropout` > 0: segmentation `variant` of the rows plain BPE keeps.
    """
    import datasets

    key = hashlib.blake2b(digest_size=16)  # of everything the ids depend on
    dropout = [f"bpe_dropout={bpe_dropout}", f"variant={variant}"] if bpe_dropout else []
    for part in (f"tmt-token-cache-{CACHE_FORMAT}", f"max_len={max_len}", f"drop_long={drop_long}",
                 f"encode_special_tokens={tokenizers.src.encode_special_tokens}",
                 tokenizers.src.to_str(), "" if tokenizers.joint else tokenizers.tgt.to_str(), text_digest, *dropout):
        key.update(part.encode("utf-8") + b"\0")  # "\0": moving text between parts changes the key
    path = Path(cache_root) / f"{name}-{key.hexdigest()}"
    dataset = _load_entry(path)
    if dataset is not None:
        logger.info("%s split: token ids from the cache %s", name, path)
    elif prepared:
        raise missing_from_rank0(path)
    else:  # a bar only on a terminal: the log line below says what happened
        dataset = _encode_to_entry(split, tokenizers, max_len, drop_long, path, name, num_proc, bpe_dropout,
                                   progress and sys.stderr.isatty())
    if len(dataset) == 0:
        raise DataError(f"no {'training' if drop_long else name} pair fits in model.max_len={max_len} tokens")
    removed = len(split) - len(dataset)
    if removed and not bpe_dropout:  # a variant drops the plain entry's pairs, logged once
        logger.info("filter too_many_tokens: removed %d %s pairs with a side longer than %d tokens, the most "
                    "model.max_len=%d leaves (not truncated; raise model.max_len to train on them)",
                    removed, name, token_room(max_len), max_len)
    src_text, tgt_text = (split["src"][:], split["tgt"][:]) if keep_text else (None, None)
    return TokenizedSplit(dataset, max_len, src_text, tgt_text)


def _load_entry(path: Path) -> datasets.Dataset | None:
    """The cached ids in `path` (memory-mapped), or None without a complete entry (a file missing or cut short)."""
    import datasets

    try:
        entry = json.loads((path / ENTRY_FILE).read_text(encoding="utf-8"))
        files = entry["files"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None
    if not files or not all((path / name).is_file() for name in files):
        return None
    try:  # a file cut short raises OSError or pyarrow's ArrowInvalid (a ValueError)
        parts = [datasets.Dataset.from_file(str(path / name)) for name in files]
    except (OSError, ValueError):
        return None
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    # A stream cut at a record-batch boundary reads without error, only shorter.
    return dataset if entry.get("rows", len(dataset)) == len(dataset) else None


def _encode_to_entry(split: datasets.Dataset, tokenizers: TokenizerPair, max_len: int, drop_long: bool,
                     path: Path, name: str, num_proc: int, bpe_dropout: float = 0.0, bar: bool = False
                     ) -> datasets.Dataset:
    """Encode into a temporary folder listed by `entry.json`, renamed into place; drop the split's older entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    with removed_on_failure(temp, f"the token cache of the {name} split"):  # Ctrl-C, a full disk: no half entry
        dataset = _encode(split, tokenizers, max_len, drop_long, temp / "ids.arrow", name, num_proc, bpe_dropout, bar)
        if len(dataset) == 0:
            shutil.rmtree(temp, ignore_errors=True)
            return dataset
        files = [Path(f["filename"]).name for f in dataset.cache_files]  # in row order
        with naming(temp / ENTRY_FILE):
            (temp / ENTRY_FILE).write_text(json.dumps({"files": files, "rows": len(dataset)}) + "\n", encoding="utf-8")
        del dataset
        if path.exists():  # an entry `_load_entry` rejected (damaged): replace it
            shutil.rmtree(path)
        temp.rename(path)
    for old in path.parent.glob(f"{name}-*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    dataset = _load_entry(path)
    logger.info("%s split: tokenized %d pairs once (%d process%s); token ids cached in %s", name, len(dataset),
                num_proc, "" if num_proc == 1 else "es", path)
    return dataset


def _encode(split: datasets.Dataset, tokenizers: TokenizerPair, max_len: int, drop_long: bool,
            cache_file: Path, name: str, num_proc: int, bpe_dropout: float = 0.0, bar: bool = False
            ) -> datasets.Dataset:
    """Encode the split into `cache_file`, or one file per shard of `num_proc` processes of tmt's own pool (a line
    as its words' ids, `WordIds`; `encode_batch` on one Rust thread a process); `bar`: a progress bar."""
    import datasets

    dropping = tokenizers.with_bpe_dropout(bpe_dropout) if bpe_dropout else None
    src_words = WordIds(tokenizers.src)
    words = (src_words, src_words if tokenizers.joint else WordIds(tokenizers.tgt))
    encode = functools.partial(_encode_rows, tokenizers=tokenizers, keep=token_room(max_len), drop_long=drop_long,
                               dropping=dropping, words=words)
    if num_proc == 1:
        files = [_encode_shard(split, encode, cache_file, f"tokenize {name}" if bar else None)]
    else:
        shards = [(split.shard(num_proc, index, contiguous=True), encode,
                   cache_file.with_name(f"{cache_file.stem}_{index:05d}_of_{num_proc:05d}.arrow"),
                   f"tokenize {name} (1 of {num_proc} shards)" if index == 0 and bar else None)
                  for index in range(num_proc)]
        with mock.patch.dict(os.environ, TOKENIZERS_PARALLELISM="false"):  # one Rust thread per process
            files = _encode_in_processes(shards, name)
    return datasets.concatenate_datasets([datasets.Dataset.from_file(file) for file in files])


def _encode_in_processes(shards: list[tuple], name: str) -> list[str]:
    """`_encode_shard` of each shard in a process of its own, their files in shard order. Whatever ends this
    early (Ctrl-C, SIGTERM, a failed shard) first kills every process and waits for it: none outlives it,
    none writes on into the folder the caller removes next."""
    # fork where it is safe (Linux): no re-import per process; macOS's system libraries are not fork-safe.
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    processes, answers = [], []
    try:
        with signals_deferred():  # a signal now would be lost in `os.fork`; it is raised once all have started
            for shard in shards:
                answer, send = context.Pipe(duplex=False)
                process = context.Process(target=_shard_process, args=(send, os.getpid(), *shard), daemon=True)
                processes.append(process)
                answers.append(answer)
                process.start()
                send.close()  # the process holds the only writing end: its death is the reader's EOF
        files = []
        for number, (process, answer) in enumerate(zip(processes, answers), 1):
            try:
                outcome = answer.recv()
            except EOFError:  # it died without answering: killed (out of memory?) or crashed
                process.join(STOP_WAIT_S)
                raise DataError(f"tokenizing the {name} split: process {number} of {len(processes)} ended without "
                                f"its shard (exit code {process.exitcode}; out of memory? data.num_proc "
                                f"sets how many run)") from None
            if isinstance(outcome, BaseException):
                raise outcome
            files.append(outcome)
        for process in processes:
            process.join(STOP_WAIT_S)  # each has answered and is ending
        return files
    finally:
        for process in processes:
            if process.pid is not None and process.exitcode is None:
                process.kill()  # what it wrote is in the folder the caller removes
        for process in processes:
            if process.pid is not None:
                process.join(STOP_WAIT_S)  # SIGKILL'ed: gone at once, unless stuck in the kernel (a dead disk)


def _shard_process(send, parent: int, split: datasets.Dataset, encode, cache_file: Path, desc: str | None) -> None:
    """A tokenizing process: its shard's file name, or the exception that stopped it, sent to the parent."""
    _worker_setup(parent)
    try:
        outcome = _encode_shard(split, encode, cache_file, desc)
    except Exception as err:  # raised again in the parent (an OSError keeps its errno and file name)
        outcome = err
    send.send(outcome)


def _worker_setup(parent: int) -> None:
    """In each tokenizing process: leave Ctrl-C to the parent, end at SIGTERM, and (Linux) die with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call (reparented to init or a subreaper)
            os._exit(1)


def _encode_shard(split: datasets.Dataset, encode, cache_file: Path, desc: str | None) -> str:
    """Encode `split` into the Arrow stream `cache_file`, `ENCODE_BATCH_ROWS` rows at a time, and return its name
    (a pool process would pickle a Dataset back whole); `desc`: the label of a progress bar (None: no bar)."""
    import pyarrow as pa
    from tqdm import tqdm

    schema = _id_features().arrow_schema  # with `datasets`' metadata: its files, read by `Dataset.from_file`
    rows = split.with_format("arrow")
    with naming(cache_file), pa.OSFile(str(cache_file), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer, \
            tqdm(total=len(split), desc=desc, unit="pair", unit_scale=True, leave=False, file=sys.stderr,
                 dynamic_ncols=True, disable=desc is None) as bar:
        for start in range(0, len(split), ENCODE_BATCH_ROWS):
            text = rows[start:start + ENCODE_BATCH_ROWS]  # a zero-copy pyarrow slice of the memory-mapped corpus
            ids = encode({"src": text.column("src").to_pylist(), "tgt": text.column("tgt").to_pylist()})
            writer.write_batch(pa.record_batch([_list_array(ids["src_ids"]), _list_array(ids["tgt_ids"]),
                                                pa.array(ids["src_len"], pa.int32()),
                                                pa.array(ids["tgt_len"], pa.int32())], schema=schema))
            bar.update(text.num_rows)
    return str(cache_file)


def _id_features() -> datasets.Features:
    """The columns of a token cache entry."""
    import datasets

    return datasets.Features({"src_ids": datasets.Sequence(datasets.Value("int32")),
                              "tgt_ids": datasets.Sequence(datasets.Value("int32")),
                              "src_len": datasets.Value("int32"), "tgt_len": datasets.Value("int32")})


def _list_array(ids: list[list[int]]) -> pa.Array:
    """A list<int32> Arrow array of id lists, built from numpy (pyarrow's own conversion is slower)."""
    import pyarrow as pa

    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, ids), dtype=np.int32, count=len(ids)), out=offsets[1:])
    values = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _encode_rows(rows: dict, *, tokenizers: TokenizerPair, keep: int, drop_long: bool,
                 dropping: TokenizerPair | None = None, words: tuple[WordIds, WordIds] | None = None) -> dict:
    """Token ids of rows, at most `keep` a side (longer pairs dropped or cut); `dropping`: BPE-dropout ids instead;
    `words`: the source's and the target's `WordIds`."""
    src_words, tgt_words = words or (None, None)
    src_ids, tgt_ids = tokenizers.encode_src(rows["src"], words=src_words), tokenizers.encode_tgt(rows["tgt"], tgt_words)
    fits = list(range(len(src_ids)))
    if drop_long:
        fits = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids)) if len(s) <= keep and len(t) <= keep]
        src_ids, tgt_ids = [src_ids[i] for i in fits], [tgt_ids[i] for i in fits]
    if dropping is not None:
        dropped_src = dropping.encode_src([rows["src"][i] for i in fits])
        dropped_tgt = dropping.encode_tgt([rows["tgt"][i] for i in fits])
        src_ids = [d if len(d) <= keep else p for d, p in zip(dropped_src, src_ids)]
        tgt_ids = [d if len(d) <= keep else p for d, p in zip(dropped_tgt, tgt_ids)]
    if not drop_long:  # cut; with drop_long every pair left fits
        src_ids, tgt_ids = [ids[:keep] for ids in src_ids], [ids[:keep] for ids in tgt_ids]
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_len": [len(s) for s in src_ids],
            "tgt_len": [len(t) for t in tgt_ids]}
