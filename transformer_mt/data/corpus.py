"""The corpus of a run: filtered pairs per split from one or several corpora, in `<run_dir>/corpus_cache/`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer_mt.config.schema import CorpusEntry, DataConfig, language_tag
from transformer_mt.core.errors import DataError, missing_from_rank0
from transformer_mt.core.files import naming, removed_on_failure, write_text_atomic
from transformer_mt.core.run_layout import RunDir
from transformer_mt.data.filters import (REMOVED_DIR, Filter, FilterCount, Pairs, apply_filters, build_filters,
                                         counts_record, filter_counts, word_counts, write_removed)
from transformer_mt.data.sources import SPLITS, SplitSource, hub_sources, local_sources

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

FILTERS = ("empty", "too_long", "length_ratio")
EMPTY, TOO_LONG, LENGTH_RATIO = 1, 2, 3  # per-row filter verdicts (0: kept), in the order the filters apply
MANIFEST_FILE = "corpus.json"
CORPUS_FORMAT = 3  # bump when the files or the filters change meaning
HASH_BLOCK_BYTES = 8 << 20
MAX_SCAN_THREADS = 8  # threads that scan the chunks of the corpus as it is read
# `data.path`, `data.format`, ... in a message about one corpus: the keys its entry sets for itself.
_SOURCE_KEYS = re.compile(r"\bdata\.(%s)\b" % "|".join(
    field.name for field in dataclasses.fields(CorpusEntry) if field.name not in ("weight", "target_lang")))


@dataclass(frozen=True)
class Corpus:
    """Filtered sentence pairs per split, each a memory-mapped `datasets.Dataset` with str columns `src`, `tgt`."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset
    removed: dict[str, int]  # pairs removed per filter, all splits together
    digests: dict[str, str]  # each split's content digest: what caches derived from it are keyed by
    carved: tuple[str, ...]  # the splits carved from train
    train_parts: tuple[tuple[str, int], ...]  # (path, pairs) of each corpus in `train`, in row order
    filtered: tuple[FilterCount, ...] = ()  # what each of `data.filters` removed, per split it cleans
    directory: Path | None = None  # corpus_cache/, where the removed pairs are


@dataclass(frozen=True)
class OpenedCorpora:
    """The sources a run reads: train from every corpus in turn, valid and test from the first, or with
    target-language tags from every corpus (None: carved)."""

    sources: dict[str, SplitSource | None]
    train_parts: tuple[SplitSource, ...]  # each corpus's own training source, in `data.corpora` order
    labels: tuple[str, ...]  # each corpus's path


def load_corpus(cfg: DataConfig, seed: int, run_dir: Path, *, prepared: bool = False) -> Corpus:
    """Read, carve and filter the corpus of `cfg` into `run_dir/corpus_cache/` (`prepared`: rank 0's, as it is)."""
    run_dir = Path(run_dir)
    directory = RunDir(run_dir).corpus_cache
    if prepared:
        manifest = _read_manifest(directory)
        if manifest is None:
            raise missing_from_rank0(directory / MANIFEST_FILE)
        return _open_corpus(directory, manifest)
    opened = open_corpora(cfg)
    key = _corpus_key(cfg, seed, opened.sources)
    manifest = _read_manifest(directory)
    if manifest is not None and manifest.get("key") == key and manifest.get("splits_digest") in (
            None, _file_digest(RunDir(run_dir).splits)):  # the same sources, settings and carving
        logger.info("reusing the corpus read earlier into %s (its sources are unchanged)", directory)
    else:
        with removed_on_failure(RunDir(run_dir).corpus_build, "the corpus cache"):
            previous, manifest = manifest, _build(cfg, seed, opened, run_dir, key)
        changed = [s for s in SPLITS if previous and previous["digests"].get(s) != manifest["digests"][s]]
        if changed:
            logger.warning("the %s split(s) changed since this run last read its data (other files, other "
                           "contents or other filters); it goes on with the new pairs", ", ".join(changed))
    _check_filtered_share(filter_counts(manifest), cfg)
    # From the sources: a manifest may lack `carved`.
    return _open_corpus(directory, manifest, carved=tuple(split for split in SPLITS if opened.sources[split] is None))


def load_run_corpus(cfg: DataConfig, seed: int, run_dir: Path) -> Corpus:
    """The corpus of the run in `run_dir` as it read it (`tmt evaluate --split`), even if the sources changed."""
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
    # The key with the manifest's own format: a cache of another CORPUS_FORMAT is not changed data.
    if _corpus_key(cfg, seed, sources, manifest.get("format")) != manifest.get("key"):
        logger.warning("the data files of data.path %r may have changed since the run read them (another size or "
                       "modification time, or another version of the hub dataset); scoring the run's own copy "
                       "in %s. To score the current files, use --src FILE --ref FILE", _paths(cfg), directory)
    return _open_corpus(directory, manifest)


def _open_corpus(directory: Path, manifest: dict, carved: tuple[str, ...] | None = None) -> Corpus:
    """Memory-map the split files of a complete `directory`; `carved` None: as the manifest records it."""
    import datasets

    carved = tuple(manifest.get("carved", ())) if carved is None else carved
    splits = {split: datasets.Dataset.from_file(str(directory / f"{split}.arrow")) for split in SPLITS}
    logger.info("corpus: %d train, %d valid, %d test pairs", *(len(splits[s]) for s in SPLITS))
    recorded = manifest.get("train_parts") or [["", len(splits["train"])]]
    parts = tuple((str(label), int(rows)) for label, rows in recorded)
    return Corpus(**splits, removed=manifest["removed"], digests=manifest["digests"], carved=carved, train_parts=parts,
                  filtered=filter_counts(manifest), directory=directory)


def _paths(cfg: DataConfig) -> str:
    """`data.path`, or the paths of `data.corpora`, for messages."""
    return ", ".join(entry.path for entry in cfg.corpora) or cfg.path


# --- opening the sources of one or several corpora ---------------------------------------------

def open_corpora(cfg: DataConfig) -> OpenedCorpora:
    """Open every corpus's sources (local files or a hub dataset); with one corpus, its own sources."""
    if cfg.format == "none":
        raise DataError("data.format: none: this run has no corpus (its model was imported with tmt import); "
                        "name one with data.format and data.path (tmt evaluate: --src and --ref)")
    # One DataConfig per corpus: each `data.corpora` entry's source keys over `cfg`'s.
    configs = [dataclasses.replace(cfg, path=entry.path, corpora=(), format=entry.format or cfg.format,
                                   hub_config=entry.hub_config if entry.hub_config is not None else cfg.hub_config,
                                   revision=entry.revision if entry.revision is not None else cfg.revision)
               for entry in cfg.corpora] or [cfg]
    opened = [_opened(one, f"data.corpora[{i}]" if cfg.corpora else "") for i, one in enumerate(configs)]
    labels = tuple(one.path for one in configs)
    if len(opened) == 1 and not cfg.tags:
        return OpenedCorpora(opened[0], (opened[0]["train"],), labels)
    if cfg.tags:  # every corpus's sources begin with its tag; valid and test come from all of them
        opened = [{split: source and _tagged(source, entry.target_lang) for split, source in sources.items()}
                  for entry, sources in zip(cfg.corpora, opened)]
        evaluation = {split: _joined([sources[split] for sources in opened], configs) for split in ("valid", "test")}
        ignored = [f"{label} ({split})" for label, sources in zip(labels, opened) for split in evaluation
                   if evaluation[split] is None and sources[split] is not None]
        if ignored:
            logger.info("a split that not every corpus has is carved from the training pairs of all; not read: %s",
                        ", ".join(ignored))
    else:
        evaluation = {"valid": opened[0]["valid"], "test": opened[0]["test"]}
        ignored = [f"{label} ({split})" for label, sources in zip(labels[1:], opened[1:])
                   for split in ("valid", "test") if sources[split] is not None]
        if ignored:
            logger.info("validation and test come from the first corpus, %s; not read: %s", labels[0],
                        ", ".join(ignored))
    parts = tuple(sources["train"] for sources in opened)
    return OpenedCorpora({"train": _joined(list(parts), configs), **evaluation}, parts, labels)


def _joined(parts: list[SplitSource | None], configs: list[DataConfig]) -> SplitSource | None:
    """One source of `parts` in turn (each corpus's, `configs` theirs); None if any is missing."""
    if any(part is None for part in parts):
        return None
    return SplitSource(description=" + ".join(part.description for part in parts),
                       key="corpora:" + json.dumps([[one.format, part.key] for one, part in zip(configs, parts)]),
                       chunks=lambda: (chunk for part in parts for chunk in part.chunks()))


def _tagged(source: SplitSource, lang: str) -> SplitSource:
    """`source` with the target-language tag of `lang` before each non-empty source sentence."""
    tag = language_tag(lang)

    def chunks():
        for src, tgt in source.chunks():
            yield [f"{tag} {text}" if text else text for text in src], tgt

    return SplitSource(description=f"{source.description} ({tag})", key=f"{source.key} tag:{tag}", chunks=chunks)


def _opened(cfg: DataConfig, entry: str) -> dict[str, SplitSource | None]:
    """The sources of one corpus; an error names its `data.corpora` entry (the entry's keys for `data.*`'s)."""
    try:
        return hub_sources(cfg) if cfg.format == "hub" else local_sources(cfg)
    except DataError as err:
        if not entry:
            raise
        message = _SOURCE_KEYS.sub(lambda key: f"{entry}.{key[1]}", str(err))
        raise DataError(message if f"{entry}." in message else f"{entry} ({cfg.path}): {message}") from None


# --- the corpus cache ---------------------------------------------------------------------------

def _corpus_key(cfg: DataConfig, seed: int, sources: dict[str, SplitSource | None],
                corpus_format: int | None = CORPUS_FORMAT) -> str:
    """What the corpus files depend on, besides the carving in `splits.json`."""
    settings = {"format": corpus_format, "data_format": cfg.format, "src_lang": cfg.src_lang,
                "tgt_lang": cfg.tgt_lang, "max_words": cfg.max_words, "max_length_ratio": cfg.max_length_ratio,
                "valid_size": cfg.valid_size, "test_size": cfg.test_size, "seed": seed,
                "sources": {split: source.key if source else None for split, source in sources.items()}}
    if cfg.filters:  # absent without: the caches written before `data.filters` stay valid
        settings["filters"] = [dataclasses.asdict(entry) for entry in cfg.filters]
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode("utf-8"), digest_size=16).hexdigest()


def _read_manifest(directory: Path) -> dict | None:
    """The manifest of a complete `directory` (every split's file present), else None (also when damaged)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    complete = (isinstance(manifest, dict) and all(key in manifest for key in ("key", "removed", "digests"))
                and isinstance(manifest["digests"], dict) and all(split in manifest["digests"] for split in SPLITS)
                and all((directory / f"{split}.arrow").is_file() for split in SPLITS))
    return manifest if complete else None


def _build(cfg: DataConfig, seed: int, opened: OpenedCorpora, run_dir: Path, key: str) -> dict:
    """Write the splits' Arrow files and the manifest into a fresh `corpus_cache/`; return the manifest."""
    sources = opened.sources
    target = RunDir(run_dir).corpus_cache
    if target.exists() and any(target.iterdir()) and not (target / MANIFEST_FILE).is_file():
        raise DataError(f"{target} exists but tmt did not write it (no {MANIFEST_FILE}); move it, or train "
                        "in another run directory")  # never replace a folder of the user's
    build = RunDir(run_dir).corpus_build
    shutil.rmtree(build, ignore_errors=True)  # left by an interrupted start
    build.mkdir(parents=True)
    filters = build_filters(cfg)
    parts, scans = {}, {}  # split -> each of its sources' verdicts (train: one per corpus); `filters`' scans
    for split, source in sources.items():
        if source is not None:
            parts[split], scans[split] = _write_raw(opened.train_parts if split == "train" else (source,),
                                                    build / f"raw-{split}.arrow", cfg, filters)
            logger.info("read %d %s pairs from %s", sum(map(len, parts[split])), split, source.description)
    for label, own in zip(opened.labels, parts["train"]):
        if len(own) == 0:
            raise DataError(f"the training data in {label} is empty (data.format: {cfg.format})")
    verdicts = {split: np.concatenate(own) for split, own in parts.items()}
    # Carved from the first corpus's training pairs, or with tags from every corpus's.
    carve_from = sum(map(len, parts["train"])) if cfg.tags else len(parts["train"][0])
    plan = carving_plan(cfg, seed, carve_from, {s for s in SPLITS if sources[s] is None}, run_dir)
    removed = dict.fromkeys(FILTERS, 0)
    rows, digests, filtered = {}, {}, []
    (build / REMOVED_DIR).mkdir()
    origins = {split: split if sources[split] is not None else "train" for split in SPLITS}
    # The scan values of the validation and test pairs, for the filters that remove them from train.
    held_out: list[np.ndarray | None] = [None] * len(filters)
    if any(one.uses_held_out for one in filters):
        held = {split: _select(split, verdicts[origins[split]], plan)[0] for split in SPLITS if split != "train"}
        held_out = [np.concatenate([scans[origins[split]][i][picked] for split, picked in held.items()])
                    if one.uses_held_out else None for i, one in enumerate(filters)]
    for split in SPLITS:
        origin = origins[split]
        selected, split_removed = _select(split, verdicts[origin], plan)
        selected, by_filters = apply_filters(filters, split, scans[origin], selected,
                                             held_out if split == "train" else None)
        for one, gone, seen in by_filters:
            name = f"{REMOVED_DIR}/{split}.{one.label}.tsv"
            write_removed(_arrow_batches(build / f"raw-{origin}.arrow"), gone, build / name)
            filtered.append(FilterCount(one.label, split, len(gone), seen, name))
        _check_not_empty(split, selected, {**split_removed, **{f"filters.{count.filter}": count.removed
                                                               for count in filtered if count.split == split}}, cfg)
        for name, count in split_removed.items():
            removed[name] += count
            if count:
                logger.info("%s: removed %d pairs (%s)", split, count, name)
        for count in filtered:
            if count.split == split:
                logger.info("%s: data.filters %s removed %d of %d pairs", split, count.filter, count.removed,
                            count.seen)
        path = build / f"{split}.arrow"
        _write_selected(build / f"raw-{origin}.arrow", selected, path)
        rows[split], digests[split] = int(selected.sum()), _file_digest(path)
        if split == "train":
            ends = np.cumsum([len(own) for own in parts["train"]])
            train_parts = [[label, int(selected[end - len(own):end].sum())]
                           for label, own, end in zip(opened.labels, parts["train"], ends)]
    for split in verdicts:
        (build / f"raw-{split}.arrow").unlink()
    if plan:
        _warn_of_repeated_pairs(build / "train.arrow", {split: build / f"{split}.arrow" for split in plan})
    manifest = {"format": CORPUS_FORMAT, "key": key, "rows": rows, "removed": removed, "digests": digests,
                "train_parts": train_parts, "filtered": counts_record(filtered),
                "carved": list(plan), "splits_digest": _file_digest(RunDir(run_dir).splits) if plan else None}
    with naming(build / MANIFEST_FILE):
        (build / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    old = RunDir(run_dir).corpus_old  # old files are unlinked, never overwritten: a process may map them
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    build.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def _write_raw(sources: tuple[SplitSource, ...], path: Path, cfg: DataConfig,
               filters: list[Filter]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Stream `sources` in turn into an Arrow file, unfiltered -> (each source's (N_source,) uint8 verdicts,
    each of `filters`' (N,) scan of the file)."""
    import pyarrow as pa

    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
    verdicts, scans = [], [[] for _ in filters]

    def scan(src, tgt) -> tuple[np.ndarray, list[np.ndarray]]:
        pairs = Pairs(src.fill_null(""), tgt.fill_null(""))
        return rule_verdicts(pairs, cfg), [one.scan(pairs) for one in filters]

    # Arrow's kernels let go of the GIL: chunks are scanned on several cores while the next ones are read (one
    # reader feeds a few; the chunks in flight, each ~CHUNK_ROWS pairs, grow with them).
    workers = min(os.cpu_count() or 1, MAX_SCAN_THREADS)
    with naming(path), pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer, \
            ThreadPoolExecutor(workers) as pool:
        for source in sources:
            pending: deque[Future] = deque()
            done = []  # each chunk's (verdicts, scans), in order
            for src, tgt in source.chunks():
                src, tgt = pa.array(src, pa.string()), pa.array(tgt, pa.string())
                writer.write_batch(pa.record_batch([src, tgt], schema=schema))
                pending.append(pool.submit(scan, src, tgt))
                if len(pending) > 2 * workers:  # memory bounded: a few chunks in flight
                    done.append(pending.popleft().result())
            done.extend(future.result() for future in pending)
            verdicts.append(np.concatenate([own for own, _ in done]) if done else np.zeros(0, dtype=np.uint8))
            for i, into in enumerate(scans):
                into.extend(scanned[i] for _, scanned in done)
    return verdicts, [np.concatenate(scan) if scan else np.zeros(0) for scan in scans]


def rule_verdicts(pairs: Pairs, cfg: DataConfig) -> np.ndarray:
    """(N,) uint8 of a chunk of pairs: 0 (kept), or the first rule filter that drops the pair from a training
    split."""
    n_src, n_tgt = pairs.lengths("words")
    longer, shorter = np.maximum(n_src, n_tgt), np.minimum(n_src, n_tgt)
    out = np.where(longer > cfg.max_length_ratio * np.maximum(shorter, 1), LENGTH_RATIO, 0).astype(np.uint8)
    out[longer > cfg.max_words] = TOO_LONG
    chars_src, chars_tgt = pairs.lengths("characters")
    out[(chars_src == 0) | (chars_tgt == 0)] = EMPTY
    return out


def count_words(text: str) -> int:
    """Whitespace-separated words, each Chinese or Japanese character counting as one."""
    import pyarrow as pa

    return int(word_counts(pa.array([text], pa.string()))[0])


def _select(split: str, verdicts: np.ndarray, plan: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """(N,) bool: the origin file's rows that make `split` (train alone loses long pairs); the pairs removed."""
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
    """`removed`: the pairs each filter removed from `split`, the rule filters' then `filters.{label}`'s."""
    if selected.any():
        return
    if split == "train":
        counts = ", ".join(f"{name}={count}" for name, count in removed.items())
        advice = {"empty": "pairs with an empty side: check the files' columns or line alignment",
                  "too_long": "check data.max_words", "length_ratio": "check data.max_length_ratio"}
        raise DataError(f"no training pairs left after filtering (removed: {counts}); "
                        + "; ".join(advice.get(name, f"check data.{name}'s options") for name, count in removed.items()
                                    if count))
    raise DataError(f"the {split} split of {_paths(cfg).partition(', ')[0]} has no pairs with text on both sides")


def _check_filtered_share(counts: tuple[FilterCount, ...], cfg: DataConfig) -> None:
    """Stop when `data.filters` removed more than `data.max_filtered_share` of the training pairs."""
    train = [count for count in counts if count.split == "train"]
    if not train:
        return
    seen, removed = train[0].seen, sum(count.removed for count in train)
    if removed > cfg.max_filtered_share * seen:
        worst = ", ".join(f"{count.filter} {count.removed:,}" for count in sorted(train, key=lambda c: -c.removed)
                          if count.removed)
        raise DataError(f"data.filters removed {removed:,} of {seen:,} training pairs ({100 * removed / seen:.1f}%: "
                        f"{worst}), more than data.max_filtered_share={cfg.max_filtered_share:g}; check those "
                        f"filters' options, or raise data.max_filtered_share")


def _arrow_batches(path: Path) -> Iterator:
    """The record batches of an Arrow stream, by plain file reads (not a memory map held in this process)."""
    import pyarrow as pa

    with pa.OSFile(str(path)) as source:
        yield from pa.ipc.open_stream(source)


def _write_selected(raw_path: Path, selected: np.ndarray, path: Path) -> None:
    """Copy the `selected` rows of the Arrow stream `raw_path` to a new one, batch by batch."""
    import pyarrow as pa

    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
    with naming(path), pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        start = 0
        for batch in _arrow_batches(raw_path):
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


# --- valid and test carved from train -----------------------------------------------------------

def carving_plan(cfg: DataConfig, seed: int, n_rows: int, missing: set[str], run_dir: Path) -> dict[str, np.ndarray]:
    """Row indices of train to carve into each missing split: a seeded choice, recorded in `splits.json`."""
    sizes = {split: size for split, size in (("valid", cfg.valid_size), ("test", cfg.test_size)) if split in missing}
    if not sizes:
        return {}
    path = RunDir(run_dir).splits
    if path.is_file():
        plan = _load_split_plan(path, n_rows, list(sizes))
        logger.info("reusing the %s split(s) recorded in %s", "/".join(sizes), path)
        for split, size in sizes.items():
            if len(plan[split]) != size:
                logger.warning("%s keeps %d %s pairs although data.%s_size is now %d; start a new run "
                               "to re-split", path, len(plan[split]), split, split, size)
        return plan
    if n_rows < 1 + sum(sizes.values()):
        keys = " + ".join(f"data.{split}_size={size}" for split, size in sizes.items())
        raise DataError(f"train has {n_rows} pairs, too few to carve {keys} and keep at least one for training; "
                        "lower those sizes or provide valid/test files")
    chosen = np.random.default_rng(seed).choice(n_rows, size=sum(sizes.values()), replace=False)
    ends = np.cumsum(list(sizes.values()))
    plan = {split: np.sort(chosen[end - size:end]) for (split, size), end in zip(sizes.items(), ends)}
    record = {"source_rows": n_rows, "seed": seed, **{split: indices.tolist() for split, indices in plan.items()}}
    write_text_atomic(path, json.dumps(record) + "\n")
    logger.info("carved %s from %d train rows (seed %d); indices saved to %s",
                ", ".join(f"{len(plan[s])} {s}" for s in plan), n_rows, seed, path)
    return plan


def _load_split_plan(path: Path, n_rows: int, needed: list[str]) -> dict[str, np.ndarray]:
    """Read carved indices from `path`, checking they still fit the current training data."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read the saved data split ({err}); delete it to re-split") from None
    if not isinstance(saved, dict):
        raise DataError(f"{path}: expected a JSON object with source_rows, seed and row indices")
    changed = f"the training data changed since {path} was made"
    if saved.get("source_rows") != n_rows:
        raise DataError(f"{changed}: it records {saved.get('source_rows')} train rows, now there are {n_rows}; "
                        "use the original data or start a new run")
    plan = {}
    for split in needed:
        indices = saved.get(split)
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < n_rows for i in indices):
            raise DataError(f"{changed}: it has no valid '{split}' row indices for {n_rows} rows")
        plan[split] = np.asarray(indices, dtype=np.int64)
    if len(np.unique(np.concatenate(list(plan.values())))) != sum(map(len, plan.values())):
        raise DataError(f"{path}: the carved splits overlap; delete it to re-split")
    return plan


def _warn_of_repeated_pairs(train_path: Path, carved_paths: dict[str, Path]) -> None:
    """Warn when pairs carved into a split also occur in what train kept (their BLEU then reads high)."""
    carved = {split: {pair for batch in _arrow_batches(path) for pair in zip(*batch.to_pydict().values())}
              for split, path in carved_paths.items()}
    repeated = {split: set() for split in carved}
    for batch in _arrow_batches(train_path):
        for pair in zip(*batch.to_pydict().values()):
            for split, pairs in carved.items():
                if pair in pairs:
                    repeated[split].add(pair)
    for split, pairs in repeated.items():
        if pairs:
            logger.warning("%d of the %d distinct %s pairs carved from train also occur in train (the corpus repeats "
                           "pairs): %s BLEU will read high; remove them from train with data.filters: [{name: dedup, "
                           "held_out: true}], or give the corpus %s files", len(pairs), len(carved[split]), split,
                           split, split)


# --- reading a split's text ---------------------------------------------------------------------

def iter_text_batches(split: datasets.Dataset, column: str, rows: np.ndarray | None = None) -> Iterator[list[str]]:
    """The strings of one column of a corpus split, a record batch at a time (only `rows`, sorted, when given)."""
    import pyarrow as pa

    (path,) = [entry["filename"] for entry in split.cache_files]  # load_corpus: one file per split
    start = 0
    for batch in _arrow_batches(path):
        strings = batch.column(column)
        if rows is not None:
            wanted = rows[np.searchsorted(rows, start):np.searchsorted(rows, start + batch.num_rows)]
            strings = strings.take(pa.array(wanted - start))
        start += batch.num_rows
        yield strings.to_pylist()


def iter_text(split: datasets.Dataset, column: str, rows: np.ndarray | None = None) -> Iterator[str]:
    """The strings of one column (of `rows` only, when given), one at a time."""
    for batch in iter_text_batches(split, column, rows):
        yield from batch


def sample_rows(n_rows: int, max_rows: int | None, seed: int) -> np.ndarray | None:
    """Sorted, seeded random row indices, `max_rows` of them; None (all rows) when `n_rows` is no more."""
    if max_rows is None or n_rows <= max_rows:
        return None
    return np.sort(np.random.default_rng(seed).choice(n_rows, size=max_rows, replace=False))
