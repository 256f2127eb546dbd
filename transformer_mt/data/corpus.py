"""The corpus of a run: `src` / `tgt` pairs per split, filtered, as memory-mapped Arrow files.

`load_corpus` streams each split from its source (`data.sources`) into `<run_dir>/corpus_cache/`,
carves missing valid/test splits from train with a seeded shuffle (recorded in the run's
`splits.json` so a resumed run sees the same rows), and filters pairs. Nothing holds the whole
corpus in memory; the files are reused while the sources, the data settings and the carving
stay the same. `load_run_corpus` reads a finished run's splits as the run read them (`tmt evaluate`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import DataError, missing_from_rank0
from transformer_mt.core.files import removed_on_failure
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.mix import OpenedCorpora, open_corpora
from transformer_mt.data.sources import SPLITS, SplitSource
from transformer_mt.data.splits import carving_plan, warn_of_repeated_pairs

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

FILTERS = ("empty", "too_long", "length_ratio")
KEPT, EMPTY, TOO_LONG, LENGTH_RATIO = 0, 1, 2, 3  # per-row filter verdicts, in the order the filters apply
MANIFEST_FILE = "corpus.json"
CORPUS_FORMAT = 2  # bump when the files or the filters change meaning (2: `count_words`)
HASH_BLOCK_BYTES = 8 << 20
# Chinese and Japanese characters, written without spaces between words: kana and the CJK
# ideographs (extension A, the main block, compatibility, extensions B-F and supplement). One of
# them is about one word (a morpheme): a useful count for the length filters, where a Thai or
# Khmer letter, for one, would not be.
_UNSPACED = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")


@dataclass(frozen=True)
class Corpus:
    """Filtered sentence pairs per split, each a memory-mapped `datasets.Dataset` with str columns `src`, `tgt`."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset
    removed: dict[str, int]
    """Pairs removed per filter (`empty`, `too_long`, `length_ratio`), all splits together."""
    digests: dict[str, str]
    """A digest of each split's content: what a cache of anything derived from it is keyed by."""
    carved: tuple[str, ...]
    """The splits carved from train (`valid`, `test`) because the data has none of its own."""
    train_parts: tuple[tuple[str, int], ...] = ()
    """(path, pairs) of each corpus in `train`, whose rows hold them in this order (`data.corpora`;
    one part for `data.path`)."""


def load_corpus(cfg: DataConfig, seed: int, run_dir: Path, *, prepared: bool = False) -> Corpus:
    """Read the corpus described by `cfg` into `run_dir/corpus_cache/` (or reuse it), carve missing
    valid/test splits, and filter pairs.

    `seed` drives the carving shuffle; the carved row indices are saved to (or, when present,
    reused from) `run_dir / "splits.json"`. Raises `DataError` naming the file, line or key at fault.

    `prepared`: another process of the run (rank 0, see `Distributed.main_first`) has just read
    the corpus into `run_dir`; take its files as they are, without opening the sources. Every
    rank then trains on rank 0's corpus, even where its own copy of the data has another path
    or modification time (node-local copies), and only rank 0 ever writes the folder.
    """
    run_dir = Path(run_dir)
    directory = RunDir(run_dir).corpus_cache
    if prepared:
        manifest = _read_manifest(directory)
        if manifest is None:
            raise missing_from_rank0(directory / MANIFEST_FILE)
        return _open_corpus(directory, manifest)
    opened = open_corpora(cfg)
    sources = opened.sources
    key = _corpus_key(cfg, seed, sources)
    manifest = _reusable_manifest(directory, key, RunDir(run_dir).splits)
    if manifest is None:
        previous = _read_manifest(directory)  # what the run read before, if anything
        with removed_on_failure(RunDir(run_dir).corpus_build, "the corpus cache"):
            manifest = _build(cfg, seed, opened, run_dir, key)
        _warn_if_the_text_changed(previous, manifest)
    else:
        logger.info("reusing the corpus read earlier into %s (its sources are unchanged)", directory)
    # From the sources, not the manifest: one reused from before tmt recorded `carved` lacks it.
    return _open_corpus(directory, manifest, carved=tuple(split for split in SPLITS if sources[split] is None))


def load_run_corpus(cfg: DataConfig, seed: int, run_dir: Path) -> Corpus:
    """The corpus of the run in `run_dir` as the run read it: what `tmt evaluate --split` scores.

    `cfg` and `seed` are the run's own. When `run_dir/corpus_cache/` is complete its files are
    used as they are, never rebuilt or touched, so the run's test split is the one behind its
    `test_scores.json` even after the sources were moved, deleted or edited (a warning says
    which). Only without that folder (it may be deleted at any time) is it built from the
    sources, as `load_corpus` does. Raises `DataError` when there is neither folder nor sources
    to read, naming the run's `config.yaml` the data path comes from.
    """
    run_dir = Path(run_dir)
    directory, config_file = RunDir(run_dir).corpus_cache, RunDir(run_dir).config
    manifest = _read_manifest(directory)  # None: no complete copy (deleted, or never finished)
    try:
        sources = open_corpora(cfg).sources
    except DataError as err:  # moved or deleted files, a hub dataset while offline
        if manifest is None:
            raise DataError(f"{err}; that path comes from the run's config, {config_file}, and {directory} holds "
                            "no copy of the run's data to score instead: restore the data, or score files "
                            "directly with --src FILE --ref FILE") from None
        logger.warning("data.path %r of the run's config (%s) cannot be opened, so the run's own copy of its "
                       "data in %s is scored (%s)", _paths(cfg), config_file, directory, err)
        return _open_corpus(directory, manifest)
    if manifest is None:
        return load_corpus(cfg, seed, run_dir)
    # The key as the run made it, with the manifest's own format: a cache written by another
    # version of tmt (another CORPUS_FORMAT) is not changed data.
    if _corpus_key(cfg, seed, sources, manifest.get("format")) != manifest.get("key"):
        logger.warning("the data files of data.path %r may have changed since the run read them (another size or "
                       "modification time, or another version of the hub dataset); scoring the run's own copy "
                       "in %s. To score the current files, use --src FILE --ref FILE", _paths(cfg), directory)
    return _open_corpus(directory, manifest)


def _open_corpus(directory: Path, manifest: dict, carved: tuple[str, ...] | None = None) -> Corpus:
    """Memory-map the split files of a complete `directory` whose manifest is `manifest`.

    `carved`: the splits carved from train; None: as the manifest records them (none when it
    predates that record, which only the data report reads).
    """
    import datasets

    if carved is None:
        carved = tuple(manifest.get("carved", ()))

    splits = {split: datasets.Dataset.from_file(str(directory / f"{split}.arrow")) for split in SPLITS}
    logger.info("corpus: %d train, %d valid, %d test pairs", *(len(splits[s]) for s in SPLITS))
    # A manifest from before several corpora were read records no parts: one corpus.
    recorded = manifest.get("train_parts") or [["", len(splits["train"])]]
    parts = tuple((str(label), int(rows)) for label, rows in recorded)
    return Corpus(**splits, removed=manifest["removed"], digests=manifest["digests"], carved=carved, train_parts=parts)


def _paths(cfg: DataConfig) -> str:
    """`data.path`, or the paths of `data.corpora`, for messages."""
    return ", ".join(entry.path for entry in cfg.corpora) or cfg.path


def _warn_if_the_text_changed(previous: dict | None, manifest: dict) -> None:
    """Say which splits now hold other pairs than the run read before (a resumed run then goes on
    with other data, not exactly as it would have); a touched but unchanged file says nothing."""
    if previous is None:
        return
    changed = [split for split in SPLITS if previous["digests"].get(split) != manifest["digests"][split]]
    if changed:
        logger.warning("the %s split(s) changed since this run last read its data (other files, other "
                       "contents or other filters); it goes on with the new pairs", ", ".join(changed))


def _corpus_key(cfg: DataConfig, seed: int, sources: dict[str, SplitSource | None],
                corpus_format: int | None = CORPUS_FORMAT) -> str:
    """What the corpus files depend on, besides the carving in `splits.json`."""
    settings = {"format": corpus_format, "data_format": cfg.format, "src_lang": cfg.src_lang,
                "tgt_lang": cfg.tgt_lang, "max_words": cfg.max_words, "max_length_ratio": cfg.max_length_ratio,
                "valid_size": cfg.valid_size, "test_size": cfg.test_size, "seed": seed,
                "sources": {split: source.key if source else None for split, source in sources.items()}}
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode("utf-8"), digest_size=16).hexdigest()


def _reusable_manifest(directory: Path, key: str, splits_path: Path) -> dict | None:
    """The manifest of `directory` when its files were made from the same key and carving, else None."""
    manifest = _read_manifest(directory)
    if manifest is None or manifest.get("key") != key:
        return None
    if manifest.get("splits_digest") is not None and _file_digest(splits_path) != manifest["splits_digest"]:
        return None  # splits.json was edited or removed: carve again
    return manifest


def _read_manifest(directory: Path) -> dict | None:
    """The manifest of a complete `directory` (every split's file present), else None; also None
    for a manifest without what tmt writes in it (damaged: the folder is then read again)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict) or not all(key in manifest for key in ("key", "removed", "digests")):
        return None
    if not isinstance(manifest["digests"], dict) or not all(split in manifest["digests"] for split in SPLITS):
        return None
    if not all((directory / f"{split}.arrow").is_file() for split in SPLITS):
        return None
    return manifest


# --- building the corpus files -----------------------------------------------------------------

def _build(cfg: DataConfig, seed: int, opened: OpenedCorpora, run_dir: Path, key: str) -> dict:
    """Write train/valid/test Arrow files and the manifest into a fresh `corpus_cache/`; return the manifest.

    Several corpora (`opened.train_parts`): their training pairs one after another in `train`,
    the first corpus's rows first, so carving (from the first corpus only) takes its rows."""
    sources = opened.sources
    target = RunDir(run_dir).corpus_cache
    if target.exists() and any(target.iterdir()) and not (target / MANIFEST_FILE).is_file():
        raise DataError(f"{target} exists but tmt did not write it (no {MANIFEST_FILE}); move it, or train "
                        "in another run directory")  # never replace a folder of the user's
    build = RunDir(run_dir).corpus_build
    shutil.rmtree(build, ignore_errors=True)  # left by an interrupted start
    build.mkdir(parents=True)
    verdicts, part_verdicts = {}, []  # part_verdicts: each corpus's part of train
    for split, source in sources.items():
        if source is not None:
            own = _write_raw(opened.train_parts if split == "train" else (source,), build / f"raw-{split}.arrow", cfg)
            part_verdicts = own if split == "train" else part_verdicts
            verdicts[split] = np.concatenate(own)
            logger.info("read %d %s pairs from %s", len(verdicts[split]), split, source.description)
    for label, own in zip(opened.labels, part_verdicts):
        if len(own) == 0:
            raise DataError(f"the training data in {label} is empty (data.format: {cfg.format})")
    n_first = len(part_verdicts[0])  # valid/test are carved from the first corpus's training pairs
    plan = carving_plan(cfg, seed, n_first, {s for s in SPLITS if sources[s] is None}, run_dir)
    removed = dict.fromkeys(FILTERS, 0)
    rows, digests = {}, {}
    for split in SPLITS:
        origin = split if sources[split] is not None else "train"
        selected, split_removed = _select(split, verdicts[origin], plan)
        _check_not_empty(split, selected, split_removed, cfg)
        for name, count in split_removed.items():
            removed[name] += count
            if count:
                logger.info("%s: removed %d pairs (%s)", split, count, name)
        path = build / f"{split}.arrow"
        _write_selected(build / f"raw-{origin}.arrow", selected, path)
        rows[split], digests[split] = int(selected.sum()), _file_digest(path)
        if split == "train":
            ends = np.cumsum([len(own) for own in part_verdicts])
            train_parts = [[label, int(selected[end - len(own):end].sum())]
                           for label, own, end in zip(opened.labels, part_verdicts, ends)]
    for split in verdicts:
        (build / f"raw-{split}.arrow").unlink()
    if plan:
        warn_of_repeated_pairs(build / "train.arrow", {split: build / f"{split}.arrow" for split in plan})
    manifest = {"format": CORPUS_FORMAT, "key": key, "rows": rows, "removed": removed, "digests": digests,
                "train_parts": train_parts,
                "carved": list(plan), "splits_digest": _file_digest(RunDir(run_dir).splits) if plan else None}
    (build / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    _replace_directory(build, target, RunDir(run_dir).corpus_old)
    return manifest


def _write_raw(sources: tuple[SplitSource, ...], path: Path, cfg: DataConfig) -> list[np.ndarray]:
    """Stream `sources`, one after another, into an Arrow file unfiltered; return each source's
    rows' filter verdicts, (N_source,) uint8."""
    import pyarrow as pa

    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
    verdicts = []
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for source in sources:
            own = []
            for src, tgt in source.chunks():
                writer.write_batch(pa.record_batch([pa.array(src, pa.string()), pa.array(tgt, pa.string())],
                                                   schema=schema))
                own.append(_verdicts(src, tgt, cfg))
            verdicts.append(np.concatenate(own) if own else np.zeros(0, dtype=np.uint8))
    return verdicts


def _verdicts(src: list[str], tgt: list[str], cfg: DataConfig) -> np.ndarray:
    """(N,) uint8: KEPT, or the first filter that drops the pair from a training split."""
    out = np.zeros(len(src), dtype=np.uint8)
    for i, (s, t) in enumerate(zip(src, tgt)):
        if not s or not t:
            out[i] = EMPTY
            continue
        n_src, n_tgt = count_words(s), count_words(t)
        if max(n_src, n_tgt) > cfg.max_words:
            out[i] = TOO_LONG
        elif max(n_src, n_tgt) / max(min(n_src, n_tgt), 1) > cfg.max_length_ratio:
            out[i] = LENGTH_RATIO
    return out


def count_words(text: str) -> int:
    """Whitespace-separated words, where each Chinese or Japanese character counts as one: else
    a whole Chinese sentence would be one word, and nearly every English-Chinese pair would fail
    `data.max_length_ratio`. (Other scripts written without spaces, such as Thai, still count
    by whitespace: segment such text into words first, or raise `data.max_length_ratio`.)"""
    n_unspaced = len(_UNSPACED.findall(text))
    if not n_unspaced:
        return len(text.split())
    return n_unspaced + len(_UNSPACED.sub(" ", text).split())


def _select(split: str, verdicts: np.ndarray, plan: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """(N,) bool: the rows of the origin file that make up `split`, and the pairs each filter removed.

    Empty pairs are dropped everywhere; over-long or badly length-ratioed pairs from train
    only: dropping hard sentences from an evaluation set would inflate its scores and make them
    incomparable with other systems.
    """
    candidates = np.ones(len(verdicts), dtype=bool)
    if split in plan:  # carved from train
        candidates[:] = False
        candidates[plan[split]] = True
    elif split == "train":
        for indices in plan.values():
            candidates[indices] = False
    own = verdicts[candidates]
    drops = (EMPTY, TOO_LONG, LENGTH_RATIO) if split == "train" else (EMPTY,)
    removed = {name: int((own == code).sum()) if code in drops else 0
               for name, code in zip(FILTERS, (EMPTY, TOO_LONG, LENGTH_RATIO))}
    return candidates & ~np.isin(verdicts, drops), removed


def _check_not_empty(split: str, selected: np.ndarray, removed: dict[str, int], cfg: DataConfig) -> None:
    if selected.any():
        return
    if split == "train":
        counts = ", ".join(f"{name}={count}" for name, count in removed.items())
        advice = {"empty": "pairs with an empty side: check the files' columns or line alignment",
                  "too_long": "check data.max_words", "length_ratio": "check data.max_length_ratio"}
        raise DataError(f"no training pairs left after filtering (removed: {counts}); "
                        + "; ".join(advice[name] for name, count in removed.items() if count))
    raise DataError(f"the {split} split of {_paths(cfg).partition(', ')[0]} has no pairs with text on both sides")


def _write_selected(raw_path: Path, selected: np.ndarray, path: Path) -> None:
    """Copy the `selected` rows of the Arrow stream `raw_path` to a new one, batch by batch.

    Read with plain file reads, not a memory map: the pass then leaves the file's pages in the
    OS page cache rather than in this process's resident memory (10 M pairs: 2 GB).
    """
    import pyarrow as pa

    with pa.OSFile(str(raw_path)) as source:
        reader = pa.ipc.open_stream(source)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, reader.schema) as writer:
            start = 0
            for batch in reader:
                keep = selected[start:start + batch.num_rows]
                start += batch.num_rows
                if keep.any():
                    writer.write_batch(batch.filter(pa.array(keep)))


def _file_digest(path: Path) -> str | None:
    """blake2b of a file's bytes, read in blocks; None when there is no such file."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK_BYTES):
                digest.update(block)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def _replace_directory(new: Path, target: Path, old: Path) -> None:
    """Put `new` in place of `target`. Files the old one held stay readable to whoever has them
    open (memory-mapped by a running process): they are unlinked, never overwritten."""
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def iter_text_batches(split: datasets.Dataset, column: str, rows: np.ndarray | None = None) -> Iterator[list[str]]:
    """The strings of one column (`src` or `tgt`) of a corpus split, a record batch at a time;
    only those of `rows` (sorted row indices) when given.

    Read from the split's Arrow file with plain file reads, not through its memory map, for the
    reason `_write_selected` gives.
    """
    import pyarrow as pa

    (path,) = [entry["filename"] for entry in split.cache_files]  # load_corpus: one file per split
    start = 0
    with pa.OSFile(path) as source:
        for batch in pa.ipc.open_stream(source):
            strings = batch.column(column)
            if rows is not None:
                wanted = rows[np.searchsorted(rows, start):np.searchsorted(rows, start + batch.num_rows)]
                strings = strings.take(pa.array(wanted - start))
            start += batch.num_rows
            yield strings.to_pylist()


def iter_text(split: datasets.Dataset, column: str, rows: np.ndarray | None = None) -> Iterator[str]:
    """The strings of one column (of `rows` only, when given), one at a time, without reading
    the column into memory."""
    for batch in iter_text_batches(split, column, rows):
        yield from batch


def sample_rows(n_rows: int, max_rows: int | None, seed: int) -> np.ndarray | None:
    """Sorted, seeded random row indices, `max_rows` of them; None (all rows) when `n_rows` is no more."""
    if max_rows is None or n_rows <= max_rows:
        return None
    return np.sort(np.random.default_rng(seed).choice(n_rows, size=max_rows, replace=False))
